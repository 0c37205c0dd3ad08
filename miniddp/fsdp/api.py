"""``fully_shard`` and ``MixedPrecisionPolicy``: torch FSDP2's call shape, over the default group
or a mesh (HSDP: sharded within groups of ranks, replicated across them; see ``mesh``).

Used as torch's is: apply it to each block, bottom-up, then to the root; build the optimizer
afterwards (it must see the sharded parameters)::

    for block in model.blocks:
        miniddp.fully_shard(block)
    miniddp.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())

Each call makes one unit of the parameters below ``module`` not already claimed by an inner call.
``reshard_after_forward=True`` is ZeRO-3 (torch's FULL_SHARD): parameters are gathered for the
forward, freed, gathered again for the backward; the default, ``None``, is the same but on the
root, which keeps them (it is needed again first). ``reshard_after_forward=False`` is ZeRO-2
(torch's SHARD_GRAD_OP): they stay gathered from forward to backward, trading memory for one
all-gather per unit and step; gradients and optimizer state are sharded either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from miniddp.fsdp import init, state_dict
from miniddp.fsdp.mesh import mesh_info
from miniddp.fsdp.param import FSDPParam
from miniddp.fsdp.param_group import ParamGroup
from miniddp.fsdp.settings import TORCH_FSDP_MODULE, UnitSettings
from miniddp.fsdp.shard import DTensor
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


class FSDPModule(UnitSettings):
    """Mixed into the class of every module ``fully_shard`` was applied to (``FSDPLinear`` for a
    ``Linear``, as torch names them), for the methods below and torch's others (``settings``):
    a subclass of torch's ``FSDPModule``, as frameworks check."""

    def __new__(cls, *args, **kwargs):
        """A new module of this class (``Sequential`` sliced) is of the original class, as
        torch's: found as the first class in the MRO that is no FSDPModule (torch's picks index
        2, which here is ``UnitSettings``)."""
        orig = next(c for c in cls.__mro__
                    if not issubclass(c, (UnitSettings, TORCH_FSDP_MODULE)))
        self = orig.__new__(orig, *args, **kwargs)
        if getattr(_torchs_fully_shard_module(), "_enable_fsdp_module_new_init", True):
            self.__init__(*args, **kwargs)
        return self

    def unshard(self, async_op: bool = False):
        """Gather this unit's parameters now (they are freed again at the next reshard).
        ``async_op``: return a handle whose ``wait()`` copies them out (the unit's pre-forward
        waits too)."""
        group = self._fsdp_state.group
        if group is not None:
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters and register the shards again."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """``False``: backward accumulates full gradients on each rank, with no communication
        (gradient accumulation over micro-batches); the next backward with ``True`` reduces the
        sum. Costs the memory of unsharded gradients meanwhile. Under HSDP it sets
        :meth:`set_requires_all_reduce` too, as torch's does."""
        for state in _states(self, recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync
                state.group.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters each backward's gradients inside the shard group but
        skips the all-reduce across the replicas (the slow links): the reduce-scattered rows add
        up, in the reduce dtype, and the next backward with ``True`` all-reduces the sum. Costs
        a shard's memory, not a whole gradient's; ``.grad`` stays as it was meanwhile."""
        for state in _states(self, recurse):
            if state.group is not None:
                state.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        """Switch between ZeRO-3 (``True``) and ZeRO-2 (``False``) for later forwards (the
        root too: the user's choice now holds there)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward)}")
        for state in _states(self, recurse):
            state.auto_reshard = False
            if state.group is not None:
                state.group.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """``False``: keep the parameters gathered after backward (during gradient accumulation,
        memory for one all-gather fewer per micro-batch); the next forward finds them so."""
        for state in _states(self, recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.cuda()``, ``.half()`` and the like, refused when they would move or cast a
        shard: its unit gathers in the dtype and on the device it was sharded with. Shards on the
        meta device are the exception: ``to_empty`` materializes them (meta-device init), and
        each is padded into a buffer of its own again."""
        for state in _states(self, recurse=True):
            if state.group is not None:
                state.group.reshard()
        for name, param in self.named_parameters():
            if isinstance(param, DTensor) and not param.is_meta:
                moved = fn(param)
                if moved.device != param.device or moved.dtype != param.dtype:
                    raise NotImplementedError(
                        f"{type(self).__name__} would move or cast the sharded parameter "
                        f"{name!r} ({param.dtype} on {param.device} -> {moved.dtype} on "
                        f"{moved.device}): move or cast the model before fully_shard, and use "
                        "MixedPrecisionPolicy for lower-precision compute.")
        applied = super()._apply(fn, *args, **kwargs)
        for state in _states(self, recurse=True):
            for p in state.group.params if state.group is not None else ():
                p.reset_sharded()
        return applied

    def __deepcopy__(self, memo):
        raise NotImplementedError(
            "A module sharded by miniddp.fully_shard cannot be deep-copied (neither can "
            "torch's): the copy would share nothing with the process group's other ranks. "
            "Deep-copy the model before fully_shard, or load miniddp.fsdp.full_state_dict(model) "
            "into a freshly built model.")


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns, as torch's: ``wait()`` makes the gathered
    parameters the module's."""

    def __init__(self, group: ParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


def _torchs_fully_shard_module():
    """torch's module that defines its ``FSDPModule`` (its ``__new__`` switch lives there)."""
    import sys

    return sys.modules.get(getattr(TORCH_FSDP_MODULE, "__module__", ""))


def _states(module: nn.Module, recurse: bool) -> list[FSDPState]:
    modules = module.modules() if recurse else [module]
    return [m._fsdp_state for m in modules if hasattr(m, "_fsdp_state")]


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), offload_policy=None,
                ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """Shard ``module``'s parameters (those no inner call claimed) as one unit: gathered before
    its forward, freed after it when ``reshard_after_forward`` (ZeRO-3; ``False`` is ZeRO-2,
    torch's SHARD_GRAD_OP; ``None``, the default, is ``True`` except on the root), gathered
    again for its backward, and its gradients reduce-scattered in one collective.
    Returns ``module``, whose class becomes ``FSDP<Class>`` (see :class:`FSDPModule`).

    ``mesh``: ``None`` shards over every rank; a 1-D ``DeviceMesh`` over its ranks; a 2-D one
    (replicate dim first) or a :class:`~miniddp.fsdp.mesh.HybridMesh` is HSDP: sharded over each
    shard group, its gradients all-reduced across the replicate group after the reduce-scatter.
    ``ignored_params`` are left alone: not sharded, not gathered, their gradients not reduced."""
    init.check_arguments(module, offload_policy)
    mesh = mesh_info(mesh, init.device_type(module))
    reshard_after_forward = init.reshard_choice(reshard_after_forward, mesh)
    ignored = {id(p) for p in ignored_params or ()}
    holders = init.owners(module)
    params = [FSDPParam(param, holders[id(param)], name, mp_policy.param_dtype,
                        mp_policy.reduce_dtype, mesh)
              for param, name in init.managed_params(module, ignored)]
    group = None
    if params:
        group = ParamGroup(params, reshard_after_forward is not False, mesh)
        for p in params:
            p.register(p.sharded)
        state_dict.register_hooks(group)
    module._fsdp_state = FSDPState(module, group, mp_policy, reshard_after_forward is None)
    module.__class__ = _fsdp_class(type(module))
    return module
