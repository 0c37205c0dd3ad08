"""Exercise 17b (lesson 17): the life of one FSDP unit, as torch's ``fully_shard`` drives it.

A unit (one ``fully_shard`` call) owns some parameters. Between steps each rank keeps only its
rows of each (``shards``: what the optimizer steps), and the module holds the full parameters
with their memory freed. Hooks, given (they sit in the grader and do what torch's do), call the
four methods below at four moments of every forward and backward; you write what each does:

* ``before_forward``: the forward needs the full parameters: ``gather`` them, unless they are
  gathered already;
* ``after_forward``: ``free`` them, unless this unit is the root (torch keeps the root's: the
  backward needs them first) or ``reshard_after_forward`` is False (ZeRO-2: gathered from
  forward to backward);
* ``before_backward``: the backward needs them again: gather them, unless they are gathered;
* ``after_backward``: every full parameter that needs a gradient has it in ``.grad``. With
  ``requires_gradient_sync``, ``reduce_scatter`` those gradients (one collective: this rank's
  rows of their average) and put each result in its shard's ``.grad``, added to the ``.grad``
  already there if a backward since the last step left one (two backwards, one step: they
  accumulate); then clear the full parameters' ``.grad``. Without sync, make no collective and
  leave the full gradients where they are: the next backward adds to them. Free the parameters
  either way.

And ``make_optimizer``: the optimizer the training loop steps, over what each rank keeps.

Graded by ``python lessons/grade.py 17b`` at 2 and 3 ranks beside torch's ``fully_shard`` on the
same model (two inner units and the root), over Adam steps in five runs (ZeRO-3, ZeRO-2 with
an evaluation forward after each step, two backwards per step, a backward without sync then one
with, a frozen bias in one unit and a frozen weight in the other): which units hold their full
parameters after forward and after backward (and no full-size gradient once reduce-scattered),
every collective your code makes (an all-gather of a unit already gathered is one too many),
then every gradient and parameter shard bit for bit.
"""

import torch
import torch.distributed as dist
from torch import nn

# (output, input): named all_gather_single and reduce_scatter_single from torch 2.13 on
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_sum = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk(t: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The rows ``torch.chunk(t, world_size)`` gives ``rank``: ceil(rows / world_size) of them,
    fewer or none for the last ranks."""
    rows = -(-t.shape[0] // world_size)
    return t[rank * rows:(rank + 1) * rows]


def padded(piece: torch.Tensor, rows: int) -> torch.Tensor:
    """``piece`` with rows of zeros below it up to ``rows``, flattened."""
    return torch.cat([piece, piece.new_zeros(rows - len(piece), *piece.shape[1:])]).reshape(-1)


class Unit:
    """One unit's parameters (``full``: the module's own, whose memory is freed between uses),
    each rank's rows of them (``shards``), and what the hooks call."""

    def __init__(self, params: list[nn.Parameter], reshard_after_forward: bool = True,
                 is_root: bool = False):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.full, self.is_root = list(params), is_root
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self.rows = [-(-p.shape[0] // self.world_size) for p in self.full]  # chunk 0's
        self.shards = [nn.Parameter(chunk(p.detach(), self.world_size, self.rank).clone(),
                                    requires_grad=p.requires_grad) for p in self.full]
        self.free()

    # ----- given -----

    @property
    def gathered(self) -> bool:
        """Whether the full parameters hold their values now."""
        return self.full[0].untyped_storage().size() > 0

    def gather(self) -> None:
        """One all-gather of every rank's padded shards, into the full parameters' memory."""
        mine = torch.cat([padded(s.detach(), n) for s, n in zip(self.shards, self.rows)])
        out = mine.new_empty(self.world_size, mine.numel())
        all_gather(out.view(-1), mine)
        sizes = [n * p.shape[1:].numel() for p, n in zip(self.full, self.rows)]
        for p, part in zip(self.full, out.split(sizes, dim=1)):
            p.untyped_storage().resize_(p.numel() * p.element_size())
            p.data.copy_(part.reshape(-1, *p.shape[1:])[:p.shape[0]])  # .data: autograd's
            # saved copies stay valid

    def free(self) -> None:
        """Release the full parameters' memory (their shape stays, their values go)."""
        for p in self.full:
            p.untyped_storage().resize_(0)

    def reduce_scatter(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """This rank's rows of the average over the ranks of each gradient (None for None), in
        one collective, torch's way (exercise 17): row r holds chunk r of each, padded; the
        rows summed over the ranks, then divided by the world size."""
        present = [(g, n) for g, n in zip(grads, self.rows) if g is not None]
        if not present:
            return list(grads)
        buffer = torch.cat([padded(chunk(g, self.world_size, r), n)
                            for r in range(self.world_size) for g, n in present])
        out = buffer.new_empty(buffer.numel() // self.world_size)
        reduce_scatter_sum(out, buffer)
        parts = iter(out.div_(self.world_size).split([n * g[0].numel() for g, n in present]))
        mine = []
        for g in grads:
            rows = None if g is None else chunk(g, self.world_size, self.rank)
            mine.append(None if g is None else next(parts)[:rows.numel()].view_as(rows))
        return mine

    # ----- to write -----

    def before_forward(self) -> None:
        raise NotImplementedError(
            "exercise 17b: the module's forward is about to run and needs the full "
            "parameters: gather them, unless they are gathered already (a property of the "
            "unit says whether they are). Stuck? python lessons/grade.py --hint 17b")

    def after_forward(self) -> None:
        raise NotImplementedError(
            "exercise 17b: the forward is over. Release the full parameters' memory, except "
            "on the root (torch keeps it: the backward needs it first) and under ZeRO-2 "
            "(reshard_after_forward False: kept until the backward). Stuck? python "
            "lessons/grade.py --hint 17b")

    def before_backward(self) -> None:
        raise NotImplementedError(
            "exercise 17b: the backward of this unit is about to run and needs the full "
            "parameters again: make sure they hold their values. Stuck? python "
            "lessons/grade.py --hint 17b")

    def after_backward(self) -> None:
        raise NotImplementedError(
            "exercise 17b: every full parameter that needs one has its gradient in .grad. "
            "With requires_gradient_sync, turn them into this rank's rows of their average in "
            "one collective (a given method), and give each result to its shard as its "
            ".grad, or add it to the .grad the shard already has; then the full parameters "
            "need no .grad. Without sync, send nothing and leave the full gradients for the "
            "next backward to add to. Release the full parameters' memory in both cases. "
            "Stuck? python lessons/grade.py --hint 17b")


def make_optimizer(units: list[Unit], optimizer_class, **defaults) -> torch.optim.Optimizer:
    """The optimizer of the training loop: ``optimizer_class`` with ``defaults``."""
    raise NotImplementedError(
        "exercise 17b: return an optimizer_class (with **defaults) over what each rank keeps "
        "and steps of every unit, the root's too. Stuck? python lessons/grade.py --hint 17b")
