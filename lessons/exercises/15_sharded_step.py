"""Exercise 15 (lesson 15): the sharded optimizer step, ZeRO stage 1.

After DDP has averaged the gradients, every rank would take the very same step. ZeRO stage 1
lets each rank step only its own share of the parameters, so that it keeps the optimizer state
(Adam's moments) of that share alone, and then sends its updated parameters to every other rank.
Three pieces to write:

* ``owners``: the rank that owns each parameter, by the rule of torch's
  ``ZeroRedundancyOptimizer``: the parameters taken largest first (by number of elements; equal
  sizes keep their order), each given to the rank that owns the fewest elements so far (on a
  tie, the lowest rank);
* in ``__init__``, ``self.local``: an ``optimizer_class`` over this rank's share only;
* ``step``: the local step, then every parameter sent from its owner to every rank.

Graded by ``python lessons/grade.py 15`` against torch's ``ZeroRedundancyOptimizer``: the owners
for 40 parameter lists (of one dtype, and of mixed dtypes: torch counts elements, not
bytes) at 2 and 3 ranks, the parameters and state each rank's optimizer holds,
where every parameter is sent from, and beside torch's DDP the parameters after every step bit
for bit, with SGD with momentum and with Adam, at 2 and 3 ranks.
"""

import torch
import torch.distributed as dist


def owners(params: list[torch.Tensor], world_size: int) -> list[int]:
    """The rank that owns each of ``params``, in their order: torch's partition."""
    raise NotImplementedError(
        f"exercise 15: return one rank (0 to {world_size - 1}) per parameter, the owner torch's "
        "ZeroRedundancyOptimizer gives it. Go through the parameters from the most elements to "
        "the fewest (a stable sort keeps equal sizes in their order) and give each to the rank "
        "that owns the fewest elements so far, the lowest such rank on a tie. Look up sorted "
        "(key, reverse) and Tensor.numel. Stuck? python lessons/grade.py --hint 15")


class ShardedOptimizer:
    """ZeRO stage 1: steps every parameter, keeping the state of this rank's share only."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owners = owners(self.params, self.world_size)
        self.local = None
        raise NotImplementedError(
            "exercise 15: make self.local an optimizer_class (with **defaults) over the "
            "parameters that this rank owns (self.owners), and no others: its state, Adam's two "
            "moments per element, is what sharding saves. Stuck? python lessons/grade.py "
            "--hint 15")

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One step of every parameter: this rank's share stepped here, the rest received."""
        raise NotImplementedError(
            "exercise 15: step this rank's share with its local optimizer; then every parameter "
            "must reach every rank from the one rank that stepped it, its owner. Every rank "
            "takes part in every send (the owner sends, the others receive into their copy). "
            "Look up torch.distributed.broadcast (src). Stuck? python lessons/grade.py "
            "--hint 15")
