"""The norms ``clip_grad_norm_`` takes of sharded gradients: over every rank's rows, as a
DTensor's are, so that every rank clips by the same factor, bit for bit as torch's FSDP2.

``torch.linalg.vector_norm`` (``foreach=False``, one gradient at a time) and
``torch._foreach_norm`` (the default on the CPU) of a :class:`~miniddp.fsdp.shard.ShardedTensor`
give a :class:`PartialNorm`, reduced over the ranks when first used, into a :class:`WholeNorm`.
torch refuses what its DTensors cannot do, and so does this module, on every rank and before any
collective: clipping a mix of sharded and plain gradients (a module left out of every unit,
``ignored_params``), and the infinity norm of a gradient some rank holds no rows of.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map


class WholeNorm(torch.Tensor):
    """A norm over every rank (a replicated DTensor, for the arithmetic clipping does with it):
    what it meets stays whole, and a plain tensor of more than one element, which DTensor would
    not take as replicated, is refused. ``full_tensor()`` and ``to_local()`` give it plain."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse_plain_tensors(func, tree_flatten((args, kwargs))[0])
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.__format__:  # f"{norm:.3f}", as a plain 0-d tensor allows
                return format(args[0].as_subclass(torch.Tensor), *args[1:])
            result = func(*args, **kwargs)
        return tree_map(lambda x: x.as_subclass(WholeNorm) if type(x) is torch.Tensor else x,
                        result)

    def full_tensor(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    to_local = full_tensor


def _refuse_plain_tensors(func, values) -> None:
    plain = [v for v in values if type(v) is torch.Tensor and v.numel() != 1]
    if plain and any(isinstance(v, torch.Tensor) and type(v) is not torch.Tensor
                     for v in values):
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(
            f"{name} got sharded and plain tensors together: a gradient of shape "
            f"{list(plain[0].shape)} belongs to no fully_shard unit, and its norm or clipping "
            "cannot be mixed with the sharded ones' (torch's FSDP2 refuses this too: mixed "
            "torch.Tensor and DTensor). Put every module with trainable parameters in a unit "
            "(fully_shard the root), or clip the two kinds of parameters apart.")


class PartialNorm(torch.Tensor):
    """This rank's norm of its rows, the reduction over ranks still to come (a DTensor's
    ``_NormPartial``): stacking keeps it pending, so that ``clip_grad_norm_`` reduces all its
    gradients' norms in one all-reduce, each at the place torch's stack gives it (gloo sums an
    element in an order that depends on its place, from 3 ranks on); any other use reduces it
    first. ``repr`` shows this rank's value without a collective."""

    _order: float
    _group: object  # the shard group the norm's rows were cut over (None: the default group)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)  # .shape, .dtype, .dim(): no reduction needed
        pending = func is torch.Tensor.to or (func is torch.stack and _one_order(args[0]))
        if pending:
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **kwargs)
            first = _first_partial(args)
            return partial(result, first._order, first._group)
        if func is torch.Tensor.__repr__:
            return f"PartialNorm({args[0].as_subclass(torch.Tensor)!r}, ord={args[0]._order})"
        args, kwargs = tree_map(_reduced, (args, kwargs))
        return func(*args, **kwargs)


_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.stride,
             torch.Tensor.is_floating_point}


def partial(local: torch.Tensor, order: float, group=None) -> PartialNorm:
    with torch._C.DisableTorchFunctionSubclass():
        tensor = local.as_subclass(PartialNorm)
    tensor._order, tensor._group = order, group
    return tensor


def _first_partial(args) -> PartialNorm:
    return next(x for x in tree_flatten(args)[0] if isinstance(x, PartialNorm))


def _one_order(tensors) -> bool:
    return (all(isinstance(t, PartialNorm) for t in tensors)
            and len({(t._order, id(t._group)) for t in tensors}) == 1)


def _reduced(x):
    if not isinstance(x, PartialNorm):
        return x
    with torch._C.DisableTorchFunctionSubclass():
        local = x.as_subclass(torch.Tensor)
        return reduce_over_ranks(local, x._order, x._group).as_subclass(WholeNorm)


def partial_norms(func, args, kwargs, sharded_type):
    """``func`` (a vector norm or a foreach norm) of tensors some of which are sharded: each
    sharded one's norm as a :class:`PartialNorm`, after the refusals."""
    tensors = [args[0]] if func is torch.linalg.vector_norm else list(args[0])
    order = float(kwargs.get("ord", args[1] if len(args) > 1 else 2.0))
    _refuse_plain_tensors(func, tensors)
    _refuse_an_empty_shards_infinity_norm(tensors, order, sharded_type)
    result = func(*args, **kwargs)
    norms = [result] if func is torch.linalg.vector_norm else list(result)
    norms = [partial(n, order, t._spec.group) if isinstance(t, sharded_type) else n
             for t, n in zip(tensors, norms)]
    return norms[0] if func is torch.linalg.vector_norm else norms


def _refuse_an_empty_shards_infinity_norm(tensors: list, order: float, sharded_type) -> None:
    """The infinity norm has no value on no elements, so torch raises on a rank whose shard of a
    gradient is empty (and its other ranks wait for it in the next collective until they time
    out). Here every rank knows every rank's cut, so every rank raises, at once."""
    if order not in (math.inf, -math.inf):
        return
    for tensor in tensors:
        if not isinstance(tensor, sharded_type):
            continue
        spec = tensor._spec
        empty = [r for r in range(spec.world_size) if replace(spec, rank=r).rows == 0]
        if empty:
            raise RuntimeError(
                f"the {order} norm of a gradient of shape {list(spec.full_shape)} cannot be "
                f"taken: rank {empty[0]} holds none of its rows, and the infinity norm of no "
                "elements has no value (torch's FSDP2 raises there too). Use another norm_type "
                "(2.0 is clip_grad_norm_'s default), or shape the parameter so that every rank "
                "holds rows of it.")


def reduce_over_ranks(local: torch.Tensor, order: float, group=None) -> torch.Tensor:
    """The norms over every rank's rows, from each rank's own (``local``, any shape): the largest
    for the inf-norm, else the p-th root of the all-reduced sum of p-th powers (for p = 0 and 1,
    the plain sum), as a DTensor's partial norm is reduced. Over the shard ``group`` only: under
    HSDP every replica holds the same rows (a DTensor's replicate dim needs no reduction)."""
    whole = local.clone()
    if order in (math.inf, -math.inf):
        dist.all_reduce(whole, op=dist.ReduceOp.MAX if order > 0 else dist.ReduceOp.MIN,
                        group=group)
    elif order in (0.0, 1.0):
        dist.all_reduce(whole, group=group)
    else:
        whole = whole ** order
        dist.all_reduce(whole, group=group)
        whole = whole ** (1.0 / order)
    return whole
