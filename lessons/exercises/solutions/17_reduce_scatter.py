"""Exercise 17 (lesson 17): FSDP's reduce-scatter of one unit's gradients, as torch's
``fully_shard`` does it.

After a unit's backward every rank holds the gradients of the unit's whole parameters, each from
its own batch. Each rank must end with its own shard of their average, and nothing else: the
rows ``torch.chunk(grad, world_size)`` gives it (``chunk`` below), in one collective for the
whole unit, with torch's bits. Two pieces to write:

* ``divide_factors``: the division by the world size, split into a part before the sum and a
  part after it, as torch splits it: for fp32 and bf16 none before, all after (a sum, then a
  division by W: what gloo's ``ReduceOp.AVG`` does); for fp16, whose range is small, a power of
  two before: start at 1 and, while the value you have divides W and W divided by it is larger
  than it, double it (W = 6: 1, 2, 4, and 4 does not divide 6: before is 4); after is W / before;
* ``reduce_scatter_gradients``: torch's layout, a buffer with one row per rank, row r holding
  chunk r of every gradient in order, each padded below with zeros to chunk 0's rows so that
  every row has the same length; cast to ``reduce_dtype``, then divided by before (in that
  dtype: dividing first, in fp32, rounds the smallest fp16 values otherwise); one
  reduce-scatter (``SUM``, the helper below); divided by after; this rank's row cut back into
  its shards, unpadded, in each gradient's own dtype.

Graded by ``python lessons/grade.py 17``: the factors against torch's for 1 to 8 ranks; then at
3 and 2 ranks, beside torch's ``fully_shard`` on the same model and batches, with fp32, bf16 and
fp16 reduction, the collective made (one reduce-scatter) and every rank's shards bit for bit.
What differs is named from what reached the collective (its layout, dtype and division) and
what was done to its result.
"""

import torch
import torch.distributed as dist


def chunk(t: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The rows ``torch.chunk(t, world_size)`` gives ``rank``: ceil(rows / world_size) of them,
    fewer or none for the last ranks."""
    rows = -(-t.shape[0] // world_size)
    return t[rank * rows:(rank + 1) * rows]


def reduce_scatter(output: torch.Tensor, buffer: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    """``output`` = this rank's 1/W of ``buffer`` (flat), reduced with ``op`` over the ranks
    (``reduce_scatter_single``, named ``reduce_scatter_tensor`` before torch 2.13)."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, buffer,
                                                                                 op=op)


def divide_factors(world_size: int, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """(before, after): the gradients are divided by ``before`` ahead of the sum over the
    ranks and by ``after`` once summed; before x after == world_size."""
    if reduce_dtype != torch.float16:
        return 1, world_size
    before = 1
    while world_size % before == 0 and world_size / before > before:
        before *= 2
    return before, world_size / before


def reduce_scatter_gradients(grads: list[torch.Tensor],
                             reduce_dtype: torch.dtype) -> list[torch.Tensor]:
    """This rank's shard of the average over the ranks of each of ``grads``, as torch's
    ``fully_shard`` computes it: chunk ``rank`` of each, unpadded, in the gradient's dtype."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = [-(-g.shape[0] // world_size) for g in grads]
    pieces = []
    for r in range(world_size):
        for g, n in zip(grads, rows):
            piece = chunk(g, world_size, r)
            pieces.append(torch.cat([piece, piece.new_zeros(n - len(piece), *g.shape[1:])]))
    buffer = torch.cat([p.reshape(-1) for p in pieces]).to(reduce_dtype)
    before, after = divide_factors(world_size, reduce_dtype)
    buffer.div_(before)
    out = buffer.new_empty(buffer.numel() // world_size)
    reduce_scatter(out, buffer)
    out.div_(after)
    sizes = [n * g[0].numel() for g, n in zip(grads, rows)]
    shards = [chunk(g, world_size, rank) for g in grads]
    return [part[:s.numel()].view_as(s).to(g.dtype)
            for part, s, g in zip(out.split(sizes), shards, grads)]
