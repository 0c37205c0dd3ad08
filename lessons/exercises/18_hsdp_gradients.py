"""Exercise 18 (lesson 18): HSDP's gradient path, inside the node, then across nodes, as torch's
``fully_shard`` does it on a 2-D mesh.

After a unit's backward every rank holds the full gradients of the unit, each from its own
batch. Each rank must end with its rows of their average over every rank of every node, with
torch's bits, through two groups: its shard group (the ranks of its node, which share the cut)
and its replicate group (one rank per node, each holding the same rows as this one). Exercise
17's buffer is given (``layout``: one row per rank of the shard group, row r holding chunk r of
every gradient, padded), and so is the way back (``shards_of``). Two pieces to write:

* ``divisions``: where torch divides, as (before the reduce-scatter, after it, after the
  all-reduce). For fp32 and bf16 nothing before, and each sum is averaged where it is made:
  the shard group's size after the reduce-scatter, the replicate group's after the all-reduce
  (two divisions, not one by every rank's count). For fp16 exercise 17's split of the count of
  every rank (shard size x replicate size): its power of two before, nothing in between, the
  rest after the all-reduce;
* ``reduce_gradients``: the buffer, cast to ``reduce_dtype`` and divided by before; one
  reduce-scatter inside the shard group (the fast links), divided; then one all-reduce of this
  rank's row across the replicate group (the slow links carry 1/S of the gradients), divided;
  back into shards. Both collectives sum (the helpers' default).

Graded by ``python lessons/grade.py 18``: the divisions against torch's for shard and replicate
groups of 1 to 4 ranks; then on 2 nodes of 3, 3 of 2 and 2 of 2 ranks, beside torch's
``fully_shard`` on the same 2-D mesh, model and batches, with fp32, bf16 and fp16 reduction:
every rank's shards bit for bit. What differs is named from the collectives the grader saw
(which, in which group, in what order) and what was done between them.
"""

import torch
import torch.distributed as dist


def chunk(t: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The rows ``torch.chunk(t, world_size)`` gives ``rank``: ceil(rows / world_size) of them,
    fewer or none for the last ranks."""
    rows = -(-t.shape[0] // world_size)
    return t[rank * rows:(rank + 1) * rows]


def layout(grads: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """Exercise 17's buffer, flat: ``world_size`` equal rows, row r holding chunk r of every
    gradient in order, each padded below with zeros to chunk 0's rows."""
    rows = [-(-g.shape[0] // world_size) for g in grads]
    pieces = [torch.cat([c, c.new_zeros(n - len(c), *g.shape[1:])]).reshape(-1)
              for r in range(world_size) for g, n in zip(grads, rows)
              for c in [chunk(g, world_size, r)]]
    return torch.cat(pieces)


def shards_of(row: torch.Tensor, grads: list[torch.Tensor], world_size: int,
              rank: int) -> list[torch.Tensor]:
    """This rank's ``row`` of the buffer cut back into its shard of each gradient, unpadded, in
    the gradient's dtype."""
    rows = [-(-g.shape[0] // world_size) for g in grads]
    parts = row.split([n * g[0].numel() for g, n in zip(grads, rows)])
    return [part[:c.numel()].view_as(c).to(g.dtype)
            for part, g in zip(parts, grads) for c in [chunk(g, world_size, rank)]]


def reduce_scatter(output: torch.Tensor, buffer: torch.Tensor, group) -> None:
    """``output`` = this rank's 1/W of ``buffer`` (flat) summed over ``group``'s W ranks
    (``reduce_scatter_single``, named ``reduce_scatter_tensor`` before torch 2.13)."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        output, buffer, group=group)


def all_reduce(tensor: torch.Tensor, group) -> None:
    """``tensor`` = its sum over ``group``'s ranks, in place."""
    dist.all_reduce(tensor, group=group)


def divisions(shard_size: int, replicate_size: int,
              reduce_dtype: torch.dtype) -> tuple[float, float, float]:
    """(before, after_reduce_scatter, after_all_reduce): the gradients are divided by each at
    its place; their product is every rank's count, shard_size x replicate_size."""
    raise NotImplementedError(
        "exercise 18: return (before, after_reduce_scatter, after_all_reduce), torch's places "
        "for the averaging on a 2-D mesh: for fp32 and bf16 nothing before, each group's own "
        "size after its own sum (shard_size after the reduce-scatter, replicate_size after the "
        "all-reduce); for float16 exercise 17's split of every rank's count "
        "(shard_size x replicate_size): its power of two before, 1 in between, the rest after "
        "the all-reduce. Stuck? python lessons/grade.py --hint 18")


def reduce_gradients(grads: list[torch.Tensor], shard_group, replicate_group,
                     reduce_dtype: torch.dtype) -> list[torch.Tensor]:
    """This rank's shard of the average over every rank of each of ``grads``, as torch's
    ``fully_shard`` computes it on a 2-D mesh: reduce-scattered inside ``shard_group``, then
    all-reduced across ``replicate_group``."""
    raise NotImplementedError(
        "exercise 18: take divisions(shard size, replicate size, reduce_dtype); the layout of "
        "grads over the shard group's ranks, cast to reduce_dtype and divided by before; one "
        "reduce_scatter into a tensor of one row's length inside shard_group, divided by "
        "after_reduce_scatter; one all_reduce of that row across replicate_group, divided by "
        "after_all_reduce; then shards_of it for this rank of the shard group. Look up "
        "dist.get_world_size(group), dist.get_rank(group), Tensor.div_. Stuck? python "
        "lessons/grade.py --hint 18")
