"""One ``fully_shard`` call's parameters: gathered together, freed together, reduced together.

The life of a group in one training step (ZeRO-3; ZeRO-2 skips the middle free and gather):

1. at rest each parameter is registered on its module as a :class:`ShardedParameter`;
2. :meth:`ParamGroup.unshard` (before the module's forward): every padded shard, cast to the
   compute dtype, goes into one flat buffer, one all-gather fills ``W`` such buffers, and each
   parameter's full rows are copied into its *unsharded* parameter, a leaf that the module now
   holds under the same name;
3. :meth:`ParamGroup.reshard` (after forward, when ``reshard_after_forward``): the unsharded
   parameters' memory is released and the shards registered again. Autograd keeps the unsharded
   parameters it saved; their memory comes back at the next gather;
4. unshard again in backward, before the module's gradients are computed;
5. :meth:`ParamGroup.reduce_gradients` (once every gradient of the group has arrived): one
   rank-major buffer, row r holding chunk r of every gradient padded to its chunk size, averaged
   with torch's factors (``collectives.average``); row r of the result, cut back into parameters
   and cast to the parameters' dtype, becomes (or is added to) each shard's ``.grad``.

The buffer layout and the averaging decide the bits (not the order or the timing), so both follow
torch FSDP2 exactly: another layout of the same numbers sums them in another order on gloo from 3
ranks on.
"""

from __future__ import annotations

import torch
from torch import nn

from miniddp.fsdp import collectives
from miniddp.fsdp.shard import ShardedParameter, ShardedTensor, ShardSpec, padded_shard, world


class FSDPParam:
    """One parameter: its padded shard, the shard the optimizer sees, its unsharded form."""

    def __init__(self, param: nn.Parameter, owners: list[tuple[nn.Module, str]], fqn: str,
                 param_dtype, reduce_dtype):
        world_size, rank = world()
        self.owners, self.fqn = owners, fqn
        self.spec = ShardSpec(param.shape, world_size, rank)
        self.orig_dtype = param.dtype
        # torch's clamps: a cast to the dtype one already has is no cast
        if reduce_dtype == param_dtype:
            reduce_dtype = None
        if param_dtype == self.orig_dtype or not self.orig_dtype.is_floating_point:
            param_dtype = None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.compute_dtype = param_dtype or self.orig_dtype
        with torch.no_grad():
            self.padded = padded_shard(param.detach(), self.spec)
        self.sharded = ShardedParameter(self.padded[: self.spec.rows], param.requires_grad,
                                        self.spec)
        self.unsharded = nn.Parameter(
            torch.empty(param.shape, dtype=self.compute_dtype, device=param.device),
            requires_grad=param.requires_grad)
        self.free()
        #: The gradient accumulated without sync, in ``reduce_dtype`` when that differs.
        self.accumulated: torch.Tensor | None = None

    def register(self, tensor: nn.Parameter) -> None:
        for module, name in self.owners:
            module._parameters[name] = tensor

    def free(self) -> None:
        self.unsharded.untyped_storage().resize_(0)

    def allocate(self) -> None:
        storage = self.unsharded.untyped_storage()
        wanted = self.unsharded.numel() * self.unsharded.element_size()
        if storage.size() != wanted:
            storage.resize_(wanted)

    def take_unsharded_gradient(self) -> torch.Tensor | None:
        """The gradient to reduce (this backward's, plus what no-sync steps accumulated)."""
        grad, self.unsharded.grad = self.unsharded.grad, None
        if self.accumulated is not None:
            if grad is not None:
                self.accumulated += grad
            grad, self.accumulated = self.accumulated, None
        return grad

    def keep_unsharded_gradient(self) -> None:
        """Without sync: keep this backward's gradient for the next one, in ``reduce_dtype``
        when that differs from the compute dtype (as torch does, so that the sum of
        micro-batches rounds the same)."""
        grad = self.unsharded.grad
        if grad is None:
            return
        if self.accumulated is not None:
            self.accumulated += grad
            self.unsharded.grad = None
        elif self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
            self.accumulated = grad.to(self.reduce_dtype)
            self.unsharded.grad = None

    def add_sharded_gradient(self, local: torch.Tensor) -> None:
        grad = self.sharded.grad
        if grad is None:
            self.sharded.grad = ShardedTensor.wrap(local, self.spec)
        else:
            grad += local


class ParamGroup:
    """The parameters of one ``fully_shard`` call, and the state of their memory."""

    def __init__(self, params: list[FSDPParam], reshard_after_forward: bool, group=None):
        dtypes = {p.orig_dtype for p in params} | {p.compute_dtype for p in params}
        if len({p.orig_dtype for p in params}) > 1 or len({p.compute_dtype for p in params}) > 1:
            names = ", ".join(f"{p.fqn} ({p.orig_dtype})" for p in params)
            raise NotImplementedError(
                f"miniddp.fully_shard gathers one module's parameters in one buffer, so they "
                f"must share a dtype; these do not: {names} ({sorted(map(str, dtypes))}). Apply "
                "fully_shard to the submodules separately or cast the module first.")
        self.params, self.group = params, group
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self.is_unsharded = False
        self.expected_grads = sum(p.unsharded.requires_grad for p in params)
        self.arrived = 0
        for p in params:
            if p.unsharded.requires_grad:
                p.unsharded.register_post_accumulate_grad_hook(self._gradient_arrived)
        #: Set by the forward hooks: run ``reduce_gradients`` when all gradients have arrived.
        self.on_all_gradients = None

    def unshard(self) -> None:
        if self.is_unsharded:
            return
        world_size = self.params[0].spec.world_size
        dtype = self.params[0].compute_dtype
        with torch.no_grad():
            flat = self.params[0].padded.new_empty((sum(p.padded.numel() for p in self.params),),
                                                   dtype=dtype)
            offset = 0
            for p in self.params:  # the cast to the compute dtype happens in this copy
                flat[offset:offset + p.padded.numel()].copy_(p.padded.reshape(-1))
                offset += p.padded.numel()
            gathered = flat.new_empty((world_size * flat.numel(),))
            collectives.all_gather_flat(gathered, flat, self.group)
            by_rank = gathered.view(world_size, -1)
            offset = 0
            for p in self.params:
                numel = p.padded.numel()
                rows = by_rank[:, offset:offset + numel].reshape(
                    world_size * p.spec.chunk_rows, *p.spec.full_shape[1:])
                p.allocate()
                # through .data: autograd must not count the refill as an in-place edit of a
                # tensor it saved in forward
                p.unsharded.data.copy_(rows[: p.spec.full_shape[0]])
                p.register(p.unsharded)
                offset += numel
        self.is_unsharded = True

    def reshard(self) -> None:
        if not self.is_unsharded:
            return
        for p in self.params:
            p.free()
            p.register(p.sharded)
        self.is_unsharded = False

    def _gradient_arrived(self, _param) -> None:
        self.arrived += 1
        if self.arrived == self.expected_grads and self.on_all_gradients is not None:
            self.on_all_gradients()

    def reduce_gradients(self) -> None:
        """Post-backward: reduce-scatter this backward's gradients (or keep them, without sync)
        and free the unsharded parameters."""
        self.arrived = 0
        if not self.requires_gradient_sync:
            self.reshard()
            for p in self.params:
                p.keep_unsharded_gradient()
            return
        with_grad = [(p, g) for p in self.params
                     if (g := p.take_unsharded_gradient()) is not None]
        self.reshard()
        if not with_grad:
            return
        params = [p for p, _ in with_grad]
        for p, local in zip(params, self.reduce_scatter(with_grad)):
            p.add_sharded_gradient(local)

    def reduce_scatter(self, with_grad: list[tuple[FSDPParam, torch.Tensor]]
                       ) -> list[torch.Tensor]:
        """This rank's rows of the average of every rank's gradients, one tensor per parameter,
        in the parameters' dtype: one rank-major buffer in ``reduce_dtype``, whose row r holds
        chunk r of every gradient, padded to its chunk size (torch's ``chunk_cat``).
        Empties ``with_grad``, so that the full gradients are freed before the collective."""
        world_size = with_grad[0][0].spec.world_size
        reduce_dtype = with_grad[0][0].reduce_dtype or with_grad[0][1].dtype
        params = [p for p, _ in with_grad]
        widths = [p.padded.numel() for p in params]
        buffer = torch.zeros((world_size, sum(widths)), dtype=reduce_dtype,
                             device=with_grad[0][1].device)
        offset = 0
        for (p, grad), width in zip(with_grad, widths):
            for rank in range(world_size):
                rows = grad[p.spec.chunk_rows * rank:][: p.spec.chunk_rows].reshape(-1)
                buffer[rank, offset:offset + rows.numel()].copy_(rows)
            offset += width
        del grad, rows
        with_grad.clear()  # the caller's references to the full gradients: free them now
        output = collectives.average(buffer, self.group).to(self.params[0].orig_dtype)
        shards, offset = [], 0
        for p, width in zip(params, widths):
            shards.append(output[offset:offset + width].view(p.spec.padded_shape)[: p.spec.rows])
            offset += width
        return shards
