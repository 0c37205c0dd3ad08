"""The norms ``clip_grad_norm_`` takes of sharded gradients: over every rank's rows, as a
DTensor's are, so that every rank clips by the same factor, bit for bit as torch's FSDP2.

``torch.linalg.vector_norm`` (``foreach=False``, one gradient at a time) and
``torch._foreach_norm`` (the default on the CPU) of a :class:`~miniddp.fsdp.shard.ShardedTensor`
give a :class:`WholeNorm`. torch refuses what its DTensors cannot do, and so does this module, on
every rank and before any collective: clipping a mix of sharded and plain gradients (a module
left out of every unit, ``ignored_params``), and the infinity norm of a gradient some rank holds
no rows of.
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
            result = func(*args, **kwargs)
        return tree_map(lambda x: x.as_subclass(WholeNorm) if type(x) is torch.Tensor else x,
                        result)

    def full_tensor(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    to_local = full_tensor

    def __format__(self, spec: str) -> str:  # f"{norm:.3f}", as a plain 0-d tensor allows
        return format(self.full_tensor(), spec)


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


def whole_norm(func, args, kwargs, sharded_type):
    """``func`` (a vector norm or a foreach norm) of tensors some of which are sharded: each
    sharded tensor's norm over every rank's rows, one all-reduce for the lot."""
    tensors = [args[0]] if func is torch.linalg.vector_norm else list(args[0])
    order = float(kwargs.get("ord", args[1] if len(args) > 1 else 2.0))
    _refuse_plain_tensors(func, tensors)
    _refuse_an_empty_shards_infinity_norm(tensors, order, sharded_type)
    result = func(*args, **kwargs)
    local = [result] if func is torch.linalg.vector_norm else list(result)
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, sharded_type)]
    whole = _whole_norms([local[i] for i in sharded], order) if sharded else []
    for i, norm in zip(sharded, whole):
        local[i] = norm.as_subclass(WholeNorm)
    return local[0] if func is torch.linalg.vector_norm else local


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


def _whole_norms(local_norms: list, order: float) -> list:
    """The norms over every rank's rows, from each rank's own: the largest for the inf-norm,
    else the p-th root of the all-reduced sum of p-th powers (for p = 0 and 1, the plain sum),
    as a DTensor's partial norm is reduced. One all-reduce for the lot."""
    stacked = torch.stack(local_norms)
    if order in (math.inf, -math.inf):
        op = dist.ReduceOp.MAX if order > 0 else dist.ReduceOp.MIN
        dist.all_reduce(stacked, op=op)
    elif order in (0.0, 1.0):
        dist.all_reduce(stacked)
    else:
        stacked = stacked ** order
        dist.all_reduce(stacked)
        stacked = stacked ** (1.0 / order)
    return list(stacked.unbind())
