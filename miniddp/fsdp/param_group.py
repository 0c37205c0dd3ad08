"""One ``fully_shard`` call's parameters (torch's ``FSDPParamGroup``): gathered together, freed
together, their gradients reduced together.

The life of a group in one training step (ZeRO-3; ZeRO-2 skips the free after forward and the
gather for backward):

1. at rest each parameter is registered on its module as its shard, a DTensor (``shard``);
2. :meth:`ParamGroup.pre_forward`: :meth:`unshard` (one all-gather of every padded shard, cast to
   the compute dtype, copied into each parameter's *unsharded* leaf, which the module now holds),
   and an identity autograd function on the forward's inputs that need a gradient: its backward
   runs once autograd is done with the whole unit (its gradients *and* the gradients of its
   inputs), and that is when the unit's post-backward runs;
3. :meth:`ParamGroup.post_forward`: :meth:`reshard` when ``reshard_after_forward`` (the unsharded
   parameters' memory released, the shards registered again; autograd keeps the unsharded
   leaves it saved, and their memory comes back at the next gather);
4. :meth:`ParamGroup.pre_backward` (the first gradient to reach the unit's output): gather again;
5. :meth:`ParamGroup.post_backward`: one rank-major buffer, row r holding chunk r of every
   gradient padded to its chunk size, averaged with torch's factors (``collectives.average``:
   reduce-scattered over the shard group and, under HSDP, all-reduced across the replicas);
   row r of the result, cut back into parameters and cast to the parameters' dtype, becomes (or
   is added to) each shard's ``.grad``. Without sync the gradients are kept instead; under HSDP
   without all-reduce, the reduce-scattered row is (``partial``). A unit whose inputs need no
   gradient (an embedding fed token ids) or that autograd never reached is finished at the end
   of the backward (``state``).

Each step is named in profiler traces as torch names it (``FSDP::pre_forward``, ...), and while
a profiler records, with the unit and the bytes it moves after it (``FSDP::all_gather (unit
blocks.1, 4096 bytes)``). Selective activation checkpointing counts those calls among a
region's operations and refuses a recomputation that makes more of them than the forward did,
so they are made where torch makes them, profiled or not: miniddp then trains where torch's
FSDP2 does and refuses where it refuses.

A unit called twice in a forward gets two post-backwards, each reducing what has arrived by then,
as torch's does. The buffer layout and the averaging decide the bits, so both follow torch FSDP2
exactly: another layout of the same numbers sums them in another order on gloo from 3 ranks on.
"""

from __future__ import annotations

import contextlib
from enum import Enum, auto

import torch
from torch.profiler import record_function

from miniddp.fsdp import collectives, tree
from miniddp.fsdp.context import StateContext
from miniddp.fsdp.mesh import EVERY_RANK, MeshInfo
from miniddp.fsdp.param import FSDPParam


class TrainingState(Enum):
    """Where a unit (or its group) is in the step, as torch's ``TrainingState``."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


def in_backward() -> bool:
    """Whether autograd is running a backward now (a forward then is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


class ParamGroup:
    """The parameters of one ``fully_shard`` call, and the state of their memory."""

    def __init__(self, params: list[FSDPParam], reshard_after_forward: bool,
                 mesh: MeshInfo = EVERY_RANK):
        if len({(p.orig_dtype, p.compute_dtype) for p in params}) > 1:
            names = ", ".join(f"{p.fqn} ({p.orig_dtype})" for p in params)
            raise NotImplementedError(
                f"miniddp.fully_shard gathers one module's parameters in one buffer, so they "
                f"must share a dtype; these do not: {names}. Apply fully_shard to the "
                "submodules separately or cast the module first.")
        self.params, self.mesh = params, mesh
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: all-reduce across the replicas after the sum
        self.partial: torch.Tensor | None = None  # HSDP: reduce-scattered, not yet all-reduced
        self.is_unsharded = False
        self.gathered: torch.Tensor | None = None  # all-gathered, not yet copied out
        self.training_state = TrainingState.IDLE
        #: Shared by every unit under the root from its first forward on (``state``): the order
        #: of this forward's post-forwards, whether a profiler records. Where this unit's calls
        #: sit in that order:
        self.ctx = StateContext()
        self.post_forward_indices: list[int] = []
        self.fqn = ""  # the unit's module, named from the root (at the root's first forward)
        self.unshard_in_backward = True  # False: the backward needs none of them (an embedding)
        self.reduce_unused = False  # True: a parameter without a gradient reduces zeros
        self.all_gather_comm = None  # torch's ``AllGather`` the user set, if any
        #: ``collectives.average``'s keywords set by the unit's methods (``settings``)
        self.reduce_settings: dict = {}

    def span(self, step: str, nbytes: int | None = None):
        """torch's name for ``step`` (``FSDP::all_gather``), followed while a profiler records
        by this unit's name and the bytes it moves. Always a ``record_function``, as torch
        makes one: selective checkpointing counts them."""
        if not self.ctx.profiling:
            return record_function(f"FSDP::{step}")
        unit = f"unit {self.fqn}" if self.fqn else "root unit"
        return record_function(f"FSDP::{step} ({unit}"
                               + (f", {nbytes} bytes)" if nbytes is not None else ")"))

    def gathered_bytes(self) -> int:
        """The bytes of this unit's all-gather: every rank's padded shards, in the compute
        dtype (as many as its reduce-scatter takes in, in the reduce dtype)."""
        p = self.params[0]
        return (p.spec.world_size * sum(q.padded.numel() for q in self.params)
                * p.unsharded.element_size())

    def unshard(self) -> None:
        """All-gather the shards; :meth:`wait_for_unshard` copies them out (a prefetch stops
        between the two, as torch's does)."""
        if self.is_unsharded or self.gathered is not None:
            return
        if not self.unshard_in_backward and self.training_state is TrainingState.PRE_BACKWARD:
            return
        if self.params[0].spec.world_size == 1:  # (a shard group of one: nothing to name)
            self.gathered = collectives.all_gather_params(self.params, self.mesh.shard_group,
                                                         self.all_gather_comm)
            return
        with self.span("all_gather", self.ctx.profiling and self.gathered_bytes()):
            self.gathered = collectives.all_gather_params(self.params, self.mesh.shard_group,
                                                         self.all_gather_comm)

    def wait_for_unshard(self) -> None:
        """The gathered rows into the unsharded parameters, which the modules now hold."""
        if self.gathered is None:
            return
        gathered, self.gathered = self.gathered, None
        with (self.span("all_gather_copy_out", self.ctx.profiling and gathered.numel()
                        * gathered.element_size())
              if self.params[0].spec.world_size > 1 else contextlib.nullcontext()):
            collectives.copy_out(self.params, gathered)
        for p in self.params:
            p.to_unsharded()
        self.is_unsharded = True

    def reshard(self) -> None:
        """Free the gathered parameters; in forward, only when ``reshard_after_forward``."""
        if self.training_state is TrainingState.FORWARD and not self.reshard_after_forward:
            return
        if self.is_unsharded:
            for p in self.params:
                p.free()
                p.register(p.sharded)
            self.is_unsharded = False

    # ----- the hooks' work -----

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        with self.span("pre_forward"):
            self.training_state = TrainingState.FORWARD
            self.unshard()
            self.wait_for_unshard()
            return self._call_post_backward_from_inputs(args, kwargs)

    def post_forward(self) -> None:
        with self.span("post_forward"):
            if not in_backward():  # a recomputation's backward still needs the parameters
                self.reshard()
                self.post_forward_indices.append(len(self.ctx.post_forward_order))
                self.ctx.post_forward_order.append(self)
            self.training_state = TrainingState.IDLE

    def pre_backward(self, default_prefetch: bool = True) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        with self.span("pre_backward"):
            self.training_state = TrainingState.PRE_BACKWARD
            self.unshard()
            self.wait_for_unshard()
            if default_prefetch:  # (not when the unit names its own: ``state``)
                self._backward_prefetch()

    def _backward_prefetch(self) -> None:
        """All-gather the unit whose forward ran before this call's, as torch does by default:
        its backward comes next, and copies the rows out. (No bit changes; on a GPU it overlaps;
        and it decides what a recomputation inside selective checkpointing finds.)"""
        if not self.post_forward_indices:
            return
        index = self.post_forward_indices.pop()
        if index > 0:
            self.ctx.post_forward_order[index - 1].prefetch("backward")

    def prefetch(self, pass_type: str) -> None:
        """All-gather now, for this unit's ``pass_type`` (``"forward"`` or ``"backward"``) to
        come, called from another unit's pre-forward or pre-backward (``state``, and the
        default above): the gather moves earlier, the copy-out stays at this unit's turn."""
        with self.span(f"{pass_type}_prefetch"):
            state, self.training_state = self.training_state, (
                TrainingState.FORWARD if pass_type == "forward" else TrainingState.PRE_BACKWARD)
            self.unshard()
            self.training_state = state

    def post_backward(self) -> None:
        """Reduce-scatter what this unit's backward gave (or keep it, without sync), and free
        the gathered parameters. Safe to call when the unit took no part in the backward."""
        self.training_state = TrainingState.POST_BACKWARD
        for p in self.params:
            p.accumulate_unsharded_grad_if_needed()
        if not self.requires_gradient_sync:
            if self.reshard_after_backward:
                self.reshard()
            for p in self.params:
                p.to_accumulated_grad_if_needed()
            return
        with_grad = [(p, g) for p in self.params if (g := p.take_unsharded_grad()) is not None
                     or (self.reduce_unused and p.unsharded.requires_grad
                         and (g := torch.zeros_like(p.unsharded)) is not None)]
        if self.reshard_after_backward:
            self.reshard()
        if not with_grad:
            return
        params = [p for p, _ in with_grad]
        with self.span("post_backward_reduce", self.ctx.profiling and _reduced_bytes(with_grad)):
            for p, local in zip(params, self.reduce_scatter(with_grad)):
                p.add_sharded_grad(local)

    def _call_post_backward_from_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not torch.is_grad_enabled():
            return args, kwargs
        inputs = tree.grad_tensors((args, kwargs))
        if not inputs:
            return args, kwargs
        outputs = iter(PostBackward.apply(self, *inputs))
        return tree.map_grad_tensors((args, kwargs), lambda _: next(outputs))

    def reduce_scatter(self, with_grad: list[tuple[FSDPParam, torch.Tensor]]
                       ) -> list[torch.Tensor]:
        """This rank's rows of the average of every rank's gradients, one tensor per parameter,
        in the parameters' dtype: one rank-major buffer in ``reduce_dtype``, whose row r holds
        chunk r of every gradient, padded to its chunk size (torch's ``chunk_cat``). Under HSDP
        without all-reduce, none: the reduce-scattered row is kept in ``partial``.
        Empties ``with_grad``, so that the full gradients are freed before the collective."""
        params = [p for p, _ in with_grad]
        buffer = collectives.chunk_cat(with_grad)
        with_grad.clear()  # the caller's references to the full gradients: free them now
        output, self.partial = collectives.average(buffer, self.mesh, self.partial,
                                                   self.requires_all_reduce,
                                                   **self.reduce_settings)
        if output is None:
            return []
        output = output.to(self.params[0].orig_dtype)
        shards, offset = [], 0
        for p in params:
            width = p.padded.numel()
            shards.append(output[offset:offset + width].view(p.spec.padded_shape)[: p.spec.rows])
            offset += width
        return shards


def _reduced_bytes(with_grad) -> int:
    """The bytes of the reduce-scatter's buffer: every padded chunk, in the reduce dtype."""
    return sum(p.padded.numel() * p.spec.world_size
               * torch.empty((), dtype=p.reduce_dtype or g.dtype).element_size()
               for p, g in with_grad)


class PostBackward(torch.autograd.Function):
    """The identity on a unit's inputs; its backward, which autograd runs once it has finished
    everything the unit's forward computed from them, is the unit's post-backward (torch's
    ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx, group: ParamGroup, *inputs: torch.Tensor):
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.group.post_backward()
        return (None, *grads)
