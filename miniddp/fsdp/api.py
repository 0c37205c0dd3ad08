"""``fully_shard`` and ``MixedPrecisionPolicy``: torch FSDP2's call shape, over the default group.

Used as torch's is: apply it to each block, bottom-up, then to the root; build the optimizer
afterwards (it must see the sharded parameters)::

    for block in model.blocks:
        miniddp.fully_shard(block)
    miniddp.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())

Each call makes one unit of the parameters below ``module`` not already claimed by an inner call.
``reshard_after_forward=True`` is ZeRO-3 (torch's FULL_SHARD): parameters are gathered for the
forward, freed, gathered again for the backward. ``reshard_after_forward=False`` is ZeRO-2
(torch's SHARD_GRAD_OP): they stay gathered from forward to backward, trading memory for one
all-gather per unit and step; gradients and optimizer state are sharded either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from miniddp.fsdp.param_group import FSDPParam, ParamGroup
from miniddp.fsdp.shard import ShardedParameter
from miniddp.fsdp.state import FSDPState


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Where FSDP casts, as torch's ``MixedPrecisionPolicy``.

    ``param_dtype``: the dtype of the gathered parameters, so of forward and backward (the shards
    and the optimizer stay in the parameters' own dtype). ``reduce_dtype``: the dtype gradients
    are averaged in (``None``: the compute dtype). ``output_dtype``: cast the forward's floating
    outputs to it. ``cast_forward_inputs``: cast the floating inputs to ``param_dtype``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to (``FSDPLinear`` for a
    ``Linear``, as torch names them), for the methods below."""

    def unshard(self) -> None:
        """Gather this unit's parameters now (they are freed again at the next reshard)."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.unshard()

    def reshard(self) -> None:
        """Free this unit's gathered parameters and register the shards again."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """``False``: backward accumulates full gradients on each rank, with no communication
        (gradient accumulation over micro-batches); the next backward with ``True`` reduces the
        sum. Costs the memory of unsharded gradients meanwhile."""
        for module in self.modules() if recurse else [self]:
            state = getattr(module, "_fsdp_state", None)
            if state is not None and state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        """Switch between ZeRO-3 (``True``) and ZeRO-2 (``False``) for later forwards."""
        for module in self.modules() if recurse else [self]:
            state = getattr(module, "_fsdp_state", None)
            if state is not None and state.group is not None:
                state.group.reshard_after_forward = reshard_after_forward

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.cuda()``, ``.half()`` and the like, refused when they would move or cast a
        shard: the shards are views of padded buffers that the new tensors would not be."""
        for name, param in self.named_parameters():
            if isinstance(param, ShardedParameter):
                moved = fn(param)
                if moved.device != param.device or moved.dtype != param.dtype:
                    raise NotImplementedError(
                        f"{type(self).__name__} would move or cast the sharded parameter "
                        f"{name!r} ({param.dtype} on {param.device} -> {moved.dtype} on "
                        f"{moved.device}): move or cast the model before fully_shard, and use "
                        "MixedPrecisionPolicy for lower-precision compute.")
        return super()._apply(fn, *args, **kwargs)

    def __deepcopy__(self, memo):
        raise NotImplementedError(
            "A module sharded by miniddp.fully_shard cannot be deep-copied (neither can "
            "torch's): the copy would share nothing with the process group's other ranks. "
            "Deep-copy the model before fully_shard, or load miniddp.fsdp.full_state_dict(model) "
            "into a freshly built model.")


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def _check_arguments(module, mesh, reshard_after_forward, offload_policy) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("miniddp.fully_shard shards over the default process group: call "
                           "torch.distributed.init_process_group first.")
    if not isinstance(module, nn.Module):
        raise NotImplementedError(
            f"miniddp.fully_shard takes one nn.Module, not {type(module).__name__} (torch's "
            "also takes a list of modules as one unit; miniddp does not).")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}: "
                         "apply it once per module.")
    if mesh is not None and not _is_the_whole_world(mesh):
        raise NotImplementedError(
            f"miniddp.fully_shard shards over the default process group only, not over {mesh}: "
            "leave mesh=None, or pass a 1-D mesh of every rank in order (2-D meshes, HSDP, and "
            "subgroups are not supported).")
    if not (reshard_after_forward is None or isinstance(reshard_after_forward, bool)):
        raise NotImplementedError(
            f"reshard_after_forward={reshard_after_forward!r}: miniddp supports True (ZeRO-3), "
            "False (ZeRO-2) or None; resharding to a smaller group after forward (an int) is "
            "not supported.")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError(
            f"offload_policy={offload_policy!r}: miniddp does not offload parameters to the "
            "CPU. Leave offload_policy=None.")


def _is_the_whole_world(mesh) -> bool:
    """A 1-D device mesh of ranks 0..W-1: the default group, which is torch's default mesh."""
    ranks = getattr(mesh, "mesh", None)
    return (getattr(mesh, "ndim", None) == 1 and isinstance(ranks, torch.Tensor)
            and ranks.tolist() == list(range(dist.get_world_size())))


def _owners(module: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """Every (module, attribute name, qualified name) holding each parameter (tied ones too)."""
    found: dict[int, list] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is not None:
                found.setdefault(id(param), []).append((sub, name, f"{prefix}.{name}".lstrip(".")))
    return found


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | None = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), offload_policy=None,
                ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """Shard ``module``'s parameters (those no inner call claimed) across the default group, as
    one unit: gathered before its forward, freed after it when ``reshard_after_forward`` (ZeRO-3;
    ``False`` is ZeRO-2, torch's SHARD_GRAD_OP; ``None`` is ``True`` except on the root),
    gathered again for its backward, and its gradients reduce-scattered in one collective.
    Returns ``module``, whose class becomes ``FSDP<Class>`` (see :class:`FSDPModule`).

    ``ignored_params`` are left alone: not sharded, not gathered, their gradients not reduced."""
    _check_arguments(module, mesh, reshard_after_forward, offload_policy)
    ignored = {id(p) for p in ignored_params or ()}
    owners = _owners(module)
    params = []
    for param in module.parameters():
        if isinstance(param, ShardedParameter) or id(param) in ignored:
            continue
        if param.dim() == 0 or param.is_meta:
            raise NotImplementedError(
                f"parameter {owners[id(param)][0][2]!r} is "
                f"{'a 0-d scalar' if param.dim() == 0 else 'on the meta device'}: miniddp's "
                "fully_shard shards materialized parameters along dim 0. Give it a dimension "
                "(shape [1]), materialize it, or pass it in ignored_params.")
        where = owners[id(param)]
        params.append(FSDPParam(param, [(m, n) for m, n, _ in where], where[0][2],
                                mp_policy.param_dtype, mp_policy.reduce_dtype))
    group = None
    if params:
        group = ParamGroup(params, reshard_after_forward is not False)
        for p in params:
            p.register(p.sharded)
    module._fsdp_state = FSDPState(module, group, mp_policy, reshard_after_forward)
    module.__class__ = _fsdp_class(type(module))
    return module
