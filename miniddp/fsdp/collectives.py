"""FSDP's collectives (torch's ``_fsdp_collectives``): a unit's shards gathered in one
all-gather, its gradients laid out for one reduce-scatter (and, under HSDP, all-reduced across
the replicas), and the divide factors that decide the bits.

torch 2.13 names them ``all_gather_single`` and ``reduce_scatter_single`` (the older
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` warn there); torch before 2.13 lacks the
new names, and gloo before 2.3 or so lacks the tensor forms altogether. Gloo has no reduce-scatter
algorithm of its own: torch 2.13's gloo clones the input, all_reduces all of it and keeps this
rank's row, so doing exactly that here is the same arithmetic on every torch (measured: 0 differing
elements at 2 and 3 ranks, fp32 and fp16). Gloo's AVG is a SUM followed by a division by the world
size (measured the same way), and older gloo refuses AVG, so on gloo the division is done here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from miniddp.fsdp.mesh import EVERY_RANK, MeshInfo


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``output`` (``W * input.numel()`` elements) gets every rank's ``input``, rank-major."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        output.copy_(input)
    elif hasattr(dist, "all_gather_single"):
        dist.all_gather_single(output, input, group=group)
    elif _is_gloo(group):
        dist.all_gather(list(output.chunk(world_size)), input, group=group)
    else:
        dist.all_gather_into_tensor(output, input, group=group)


def reduce_scatter_mean(buffer: torch.Tensor, group=None) -> torch.Tensor:
    """Rank r's row of the sum of every rank's ``buffer`` (``W`` rows, rank-major), divided by
    ``W`` as torch's ``ReduceOp.AVG`` does: after the sum, never before (DDP's ``1/W`` before the
    sum rounds differently from 3 ranks on)."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return buffer[0].clone()
    if _is_gloo(group):
        return reduce_scatter_sum(buffer, group).div_(world_size)
    output = buffer.new_empty(buffer.shape[1:])
    _reduce_scatter(output, buffer, dist.ReduceOp.AVG, group)
    return output


def reduce_scatter_sum(buffer: torch.Tensor, group=None) -> torch.Tensor:
    """Rank r's row of the sum of every rank's ``buffer`` (``W`` rows, rank-major). On gloo the
    sum is made in ``buffer`` itself (the caller's scratch), and this rank's row copied out."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        return buffer[0].clone()
    if _is_gloo(group):
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        return buffer[rank].clone()
    output = buffer.new_empty(buffer.shape[1:])
    _reduce_scatter(output, buffer, dist.ReduceOp.SUM, group)
    return output


def _reduce_scatter(output, buffer, op, group) -> None:
    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single(output, buffer.reshape(-1), op=op, group=group)
    else:
        dist.reduce_scatter_tensor(output, buffer.reshape(-1), op=op, group=group)


def fp16_divide_factors(world_size: float) -> tuple[float, float]:
    """How fp16 gradients are averaged: divided by ``pre`` before the sum and by ``post`` after.

    Summing W fp16 gradients can overflow and dividing them all by W first can underflow, so
    torch splits W: ``pre`` doubles from 1 while it divides W and ``W / pre`` still exceeds it
    (about sqrt(W), a power of two), and ``post = W / pre``. W=3 gives (2, 1.5), W=8 (4, 2).
    (W is a unit's ``set_gradient_divide_factor`` instead when it has one.)"""
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return pre, world_size / pre


def all_reduce_mean(tensor: torch.Tensor, group) -> None:
    """``tensor`` becomes the average of every rank's in ``group``: summed, then divided (gloo's
    ``ReduceOp.AVG``, measured bit for bit; NCCL's AVG is its own)."""
    if _is_gloo(group):
        dist.all_reduce(tensor, group=group)
        tensor.div_(dist.get_world_size(group))
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)


def average(buffer: torch.Tensor, mesh: MeshInfo = EVERY_RANK, partial=None,
            all_reduce: bool = True, *, factor: float | None = None, force_sum: bool = False,
            hook=None, reduce_scatter=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This rank's row of the average of every rank's ``buffer`` (``W`` rows, rank-major), with
    torch FSDP2's arithmetic for its dtype and in its order (``foreach_reduce``):

    1. fp16 (anything but fp32 and bf16): divide by ``pre``, a power of two near the square
       root of every rank's count, so that the sums stay in fp16's range;
    2. reduce-scatter over the shard group: fp32 and bf16 averaged there (``AVG``), fp16 summed;
    3. HSDP: add the sum kept from micro-batches without all-reduce (``partial``), then
       all-reduce across the replicate group, averaged again for fp32 and bf16, summed for fp16.
       Without ``all_reduce`` (torch's ``set_requires_all_reduce(False)``), stop here: the row
       is added into ``partial``, and returned as the second value, to keep;
    4. fp16: divide by ``post``, the rest of the count.

    So an fp32 gradient is divided by the shard group's size, then by the replicate group's, each
    after its sum: not once by the count of all the ranks. Returns ``(row, None)``, or
    ``(None, partial)`` without all-reduce.

    A unit's settings (``settings``) change the steps as torch's do: ``factor``
    (``set_gradient_divide_factor``) replaces the count; ``force_sum``
    (``set_force_sum_reduction_for_comms``) sums in both collectives and divides after;
    ``hook`` (``set_all_reduce_hook``) sees the row between steps 3 and 4; ``reduce_scatter``
    (``set_custom_reduce_scatter``) makes step 2."""
    pre, post, scatter_op, all_reduce_op = divide_factors(buffer.dtype, mesh, factor, force_sum)
    if pre not in (None, 1):
        buffer.div_(pre)
    if mesh.shard_size == 1 and factor is not None:
        output = buffer[0] / factor  # (torch's copy of the input divided by the factor)
    elif reduce_scatter is not None and mesh.shard_size > 1:
        output = _custom_reduce_scatter(buffer, scatter_op, factor, mesh.shard_group,
                                        reduce_scatter)
    elif scatter_op == "avg":
        output = reduce_scatter_mean(buffer, mesh.shard_group)
    elif scatter_op == "sum":
        output = reduce_scatter_sum(buffer, mesh.shard_group)
    else:
        output = _reduce_scatter_premul(buffer, factor, mesh.shard_group)
    if mesh.replicate_group is not None:
        if not all_reduce:
            return None, output if partial is None else partial.add_(output)
        if partial is not None:
            output += partial
        if all_reduce_op == "avg":
            all_reduce_mean(output, mesh.replicate_group)
        else:
            dist.all_reduce(output, group=mesh.replicate_group)
    if hook is not None:
        hook(output)
    if post not in (None, 1):
        output.div_(post)
    return output, None


def divide_factors(dtype: torch.dtype, mesh: MeshInfo, factor: float | None = None,
                   force_sum: bool = False) -> tuple:
    """torch's ``_get_gradient_divide_factors``: ``(pre, post, reduce-scatter op, all-reduce
    op)``, each op ``"avg"``, ``"sum"`` or ``"premul"`` (multiply by ``1 / factor``, then sum)."""
    averaged = dtype in (torch.float32, torch.bfloat16)
    if averaged and not force_sum:
        if factor is None:
            return (None, None, "sum", "sum") if mesh.data_parallel_size == 1 else (
                None, None, "avg", "avg")
        return None, None, "avg" if factor == mesh.shard_size else "premul", "sum"
    factor = float(mesh.data_parallel_size) if factor is None else factor
    if averaged:
        return None, factor, "sum", "sum"
    return (*fp16_divide_factors(factor), "sum", "sum")


def _reduce_scatter_premul(buffer: torch.Tensor, factor: float, group) -> torch.Tensor:
    if _is_gloo(group):
        raise RuntimeError(
            f"set_gradient_divide_factor({factor}) on a unit sharded over "
            f"{dist.get_world_size(group)} ranks: torch's FSDP2 then multiplies by 1/{factor} "
            "inside the reduce-scatter (ReduceOp.PREMUL_SUM), and gloo has no PREMUL_SUM "
            "(torch's fails here too). Use the shard group's size as the factor, or call "
            "set_force_sum_reduction_for_comms(True) as well: the sum is then divided by the "
            "factor after the reduce-scatter.")
    output = buffer.new_empty(buffer.shape[1:])
    _reduce_scatter(output, buffer, dist._make_nccl_premul_sum(1 / factor), group)
    return output


def all_gather_params(params, group=None, comm=None) -> torch.Tensor:
    """Every rank's padded shards of ``params``, rank-major in one flat buffer: each padded
    shard, cast to the compute dtype on the way, into this rank's piece, then one all-gather
    (torch's ``foreach_all_gather``). ``comm``: torch's ``AllGather`` the user set
    (``set_custom_all_gather``), called as torch calls it: on its own buffer, whose piece for
    this rank is the input."""
    world_size = params[0].spec.world_size
    with torch.no_grad():
        flat = torch.cat([p.padded.reshape(-1).to(p.compute_dtype) for p in params])
        if comm is None or world_size == 1:
            gathered = flat.new_empty((world_size * flat.numel(),))
            all_gather_flat(gathered, flat, group)
            return gathered
        gathered = comm.allocate((world_size * flat.numel(),), dtype=flat.dtype,
                                 device=flat.device)
        piece = gathered.narrow(0, dist.get_rank(group) * flat.numel(), flat.numel())
        piece.copy_(flat)
        _wait(comm(output_tensor=gathered, input_tensor=piece, group=group or dist.group.WORLD,
                   async_op=False))
    return gathered


def _wait(work) -> None:
    if work is not None:
        work.wait()


def _custom_reduce_scatter(buffer: torch.Tensor, op: str, factor, group, comm) -> torch.Tensor:
    """torch's ``ReduceScatter`` the user set (``set_custom_reduce_scatter``), called as torch
    calls it: on buffers it allocates, with the op torch would use (gloo's AVG is the comm's
    business then)."""
    ops = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM}
    op = ops[op] if op in ops else dist._make_nccl_premul_sum(1 / factor)
    flat = comm.allocate((buffer.numel(),), dtype=buffer.dtype, device=buffer.device)
    flat.copy_(buffer.reshape(-1))
    output = comm.allocate((buffer.shape[1],), dtype=buffer.dtype, device=buffer.device)
    _wait(comm(output_tensor=output, input_tensor=flat, group=group or dist.group.WORLD, op=op,
               async_op=False))
    return output


def copy_out(params, gathered: torch.Tensor) -> None:
    """Each parameter's full rows from the gathered buffer into its (re-allocated) unsharded
    leaf (torch's ``foreach_all_gather_copy_out``)."""
    world_size = params[0].spec.world_size
    by_rank = gathered.view(world_size, -1)
    offset = 0
    with torch.no_grad():
        for p in params:
            p.allocate()
            # through .data: autograd must not count the refill as an in-place edit of a tensor
            # it saved in forward
            _copy_chunks(by_rank[:, offset:offset + p.padded.numel()], p.unsharded.data, p.spec)
            offset += p.padded.numel()


def _copy_chunks(chunks: torch.Tensor, full: torch.Tensor, spec) -> None:
    """``full``'s rows from ``chunks`` (one padded chunk per rank, a strided view), each copied
    once: the ranks whose chunk is whole in one copy, the one cut short (if any) in another."""
    rows, chunk_rows = spec.full_shape[0], spec.chunk_rows
    if full.numel() == 0:
        return
    whole, left = divmod(rows, chunk_rows)
    flat = full.view(rows, -1)
    if whole:
        flat[: whole * chunk_rows].view(whole, -1).copy_(chunks[:whole])
    if left:
        flat[whole * chunk_rows:].view(1, -1).copy_(chunks[whole:whole + 1, : flat[0].numel()
                                                           * left])


def chunk_cat(with_grad) -> torch.Tensor:
    """The reduce-scatter's input (torch's ``chunk_cat``): a ``(W, n)`` buffer in the reduce
    dtype whose row r holds, for every parameter in the group's order, chunk r of its gradient
    padded with zeros to the chunk size."""
    world_size = with_grad[0][0].spec.world_size
    reduce_dtype = with_grad[0][0].reduce_dtype or with_grad[0][1].dtype
    widths = [p.padded.numel() for p, _ in with_grad]
    buffer = torch.zeros((world_size, sum(widths)), dtype=reduce_dtype,
                         device=with_grad[0][1].device)
    offset = 0
    for (p, grad), width in zip(with_grad, widths):
        for rank in range(world_size):
            rows = grad[p.spec.chunk_rows * rank:][: p.spec.chunk_rows].reshape(-1)
            buffer[rank, offset:offset + rows.numel()].copy_(rows)
        offset += width
    return buffer
