"""One sharded parameter (torch's ``FSDPParam``): its padded shard, the shard the optimizer sees,
its unsharded form, and where its gradient waits between micro-batches.

At rest the module holds :attr:`FSDPParam.sharded`, a DTensor parameter over the top rows of
:attr:`FSDPParam.padded` (``shard``); while the unit is gathered it holds
:attr:`FSDPParam.unsharded`, one plain leaf ``nn.Parameter`` made once and refilled at every
gather (its memory released in between), so that autograd accumulates the unit's gradient into
one tensor however often the unit runs. miniddp's own steps read and write the plain tensors
(``padded``, the gradients' local rows); only what the user's code sees is a DTensor.

Something outside may replace the sharded parameter's local tensor: ``model.to_empty()`` after
building on the meta device, ``load_state_dict(assign=True)``. :meth:`FSDPParam.reset_sharded`
then pads the new rows into a buffer of their own again, as torch's ``reset_sharded_param``.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from miniddp.fsdp.mesh import MeshInfo
from miniddp.fsdp.shard import ShardSpec, as_dtensor, dtensor_spec, padded_shard

_uids = itertools.count()


def original_uid(param: nn.Parameter) -> int:
    """A number that stays with the user's parameter object, to find one parameter claimed by
    two units (torch marks the parameter the same way: ``id()`` would be reused once freed)."""
    if not hasattr(param, "_miniddp_fsdp_uid"):
        param._miniddp_fsdp_uid = next(_uids)
    return param._miniddp_fsdp_uid


class FSDPParam:
    """One parameter of a unit, in its three forms."""

    def __init__(self, param: nn.Parameter, owners: list[tuple[nn.Module, str]], fqn: str,
                 param_dtype, reduce_dtype, mesh: MeshInfo):
        self.owners, self.fqn, self.uid = owners, fqn, original_uid(param)
        self.spec = ShardSpec(param.shape, mesh.shard_size, mesh.shard_rank, mesh.shard_group)
        self.orig_dtype = param.dtype
        # torch's clamps: a cast to the dtype one already has is no cast
        if reduce_dtype == param_dtype:
            reduce_dtype = None
        if param_dtype == self.orig_dtype or not self.orig_dtype.is_floating_point:
            param_dtype = None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.compute_dtype = param_dtype or self.orig_dtype
        #: How the user's code sees the shard (and its gradient): a DTensor on the unit's mesh
        self.dspec = dtensor_spec(mesh.device_mesh, mesh.replicate_group is not None, param)
        with torch.no_grad():
            self.padded = padded_shard(param.detach(), self.spec)
        self.sharded = nn.Parameter(as_dtensor(self.padded[: self.spec.rows], self.dspec),
                                    requires_grad=param.requires_grad)
        self._new_unsharded(param.device)
        #: The gradient kept without sync, in ``reduce_dtype`` when that differs from the compute
        #: dtype (torch's ``unsharded_accumulated_grad``); else it stays in ``unsharded.grad``.
        self.accumulated: torch.Tensor | None = None

    def _new_unsharded(self, device) -> None:
        self.unsharded = nn.Parameter(
            torch.empty(self.spec.full_shape, dtype=self.compute_dtype, device=device),
            requires_grad=self.sharded.requires_grad)
        self.free()

    def reset_sharded(self) -> None:
        """Take the sharded parameter the module holds now, and pad its rows into a buffer of
        their own if they are not the top of :attr:`padded` any more (a new device, a loaded
        tensor); the unsharded parameter moves with them."""
        module, name = self.owners[0]
        self.sharded = module._parameters[name]
        local = self.sharded._local_tensor
        if local.is_meta or local.untyped_storage().data_ptr() == \
                self.padded.untyped_storage().data_ptr() != 0:
            return
        with torch.no_grad():
            padded = local.new_zeros(self.spec.padded_shape)
            padded[: self.spec.rows].copy_(local)
        self.padded = padded
        self.sharded._local_tensor = padded[: self.spec.rows]
        self.register(self.sharded)
        if self.unsharded.device != padded.device:
            self._new_unsharded(padded.device)

    def register(self, tensor: nn.Parameter) -> None:
        for module, name in self.owners:
            module._parameters[name] = tensor

    def free(self) -> None:
        if not self.unsharded.is_meta:
            self.unsharded.untyped_storage().resize_(0)

    def allocate(self) -> None:
        storage = self.unsharded.untyped_storage()
        wanted = self.unsharded.numel() * self.unsharded.element_size()
        if storage.size() != wanted:
            storage.resize_(wanted)

    def to_unsharded(self) -> None:
        """The module now holds the gathered parameter, which needs a gradient where the shard
        does, as the shard is now (a layer may be frozen or unfrozen after ``fully_shard``)."""
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        self.register(self.unsharded)

    # ----- gradients, as torch's FSDPParam keeps them -----

    def accumulate_unsharded_grad_if_needed(self) -> None:
        """Add this backward's gradient into the one kept in ``reduce_dtype``, if one is kept."""
        if self.accumulated is not None and self.unsharded.grad is not None:
            self.accumulated += self.unsharded.grad
            self.unsharded.grad = None

    def to_accumulated_grad_if_needed(self) -> None:
        """Without sync: keep the gradient in ``reduce_dtype`` when that differs from the compute
        dtype, so that micro-batches are summed in it (as torch does)."""
        grad = self.unsharded.grad
        if self.reduce_dtype is None or grad is None or grad.dtype == self.reduce_dtype:
            return
        self.unsharded.grad = None
        self.accumulated = grad.to(self.reduce_dtype)

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient to reduce-scatter now (the kept one first), and forget it here."""
        if self.accumulated is not None:
            grad, self.accumulated = self.accumulated, None
        else:
            grad, self.unsharded.grad = self.unsharded.grad, None
        return grad

    def add_sharded_grad(self, local: torch.Tensor) -> None:
        """This rank's rows of the reduced gradient become the shard's ``.grad``, or are added to
        it (a second synchronized backward accumulates); then the shard's post-accumulate-grad
        hooks run, as torch runs them (an optimizer stepped in backward)."""
        grad = self.sharded.grad
        if grad is None:
            self.sharded.grad = as_dtensor(local, self.dspec)
        else:
            grad._local_tensor += local
        for hook in (getattr(self.sharded, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(self.sharded)
