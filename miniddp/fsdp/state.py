"""The hooks that move a ``fully_shard`` unit through forward and backward (torch's
``FSDPState``).

* forward pre-hook: the first unit to run a forward becomes the *root* of every unit below it
  (and, unless the user chose, keeps its parameters gathered from forward to backward: it is
  needed again first); then cast the inputs and let the group gather and hook its inputs;
* forward hook: the group frees the parameters (``reshard_after_forward``); every output that
  needs a gradient is hooked, and the first gradient to reach one gathers them again (the
  pre-backward);
* post-backward: run by the group's identity function on the unit's inputs (``param_group``),
  once autograd is done with the unit; and at the end of the backward, in a callback the first
  pre-backward queues, for every unit that autograd did not reach through its inputs.

A forward that runs while its unit is in pre-backward is activation checkpointing recomputing it:
the parameters are gathered for it and stay so for the backward that follows. Reentrant
checkpointing runs the first forward without gradients, so the recomputation inside backward is
the unit's real forward: hooked as any, its post-backward runs when the recomputed part's
backward is done.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from miniddp import profiling
from miniddp.fsdp import tree
from miniddp.fsdp.context import StateContext
from miniddp.fsdp.param_group import ParamGroup, TrainingState


def _cast(dtype, x: torch.Tensor) -> torch.Tensor:
    return x.to(dtype) if torch.is_floating_point(x) and x.dtype != dtype else x


class FSDPState:
    """One ``fully_shard`` call: its module, its parameter group (if it has parameters), its
    mixed-precision policy and where it is in the step."""

    def __init__(self, module, group: ParamGroup | None, mp_policy, auto_reshard: bool):
        self.module, self.group, self.mp_policy = module, group, mp_policy
        #: ``reshard_after_forward=None``: the root, once known, keeps its parameters gathered
        self.auto_reshard = auto_reshard
        self.is_root: bool | None = None
        self.ctx = StateContext()
        self.training_state = TrainingState.IDLE
        #: The units this one gathers early (``set_modules_to_forward_prefetch`` and
        #: ``..._backward_prefetch``): in its pre-forward, after its own gather, in that order;
        #: in its pre-backward, in place of the default (the unit whose forward ran before)
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward)

    def _lazy_init(self) -> None:
        """At its first forward, the first unit to run one becomes the root of all below it."""
        if self.is_root is not None:
            return
        self.is_root = True
        for name, sub in self.module.named_modules():
            state = getattr(sub, "_fsdp_state", None)
            if state is None:
                continue
            if sub is not self.module:
                if state.is_root is not None:
                    raise RuntimeError(
                        f"the fully_shard unit {name!r} already ran a forward on its own, as a "
                        "root: run the first forward through the outermost module "
                        f"({type(self.module).__name__}), as torch's FSDP2 requires.")
                state.is_root = False
            state.ctx = self.ctx
            self.ctx.all_states.append(state)
            if state.group is not None:
                state.group.ctx, state.group.fqn = self.ctx, name
        if self.auto_reshard and self.group is not None:
            self.group.reshard_after_forward = False
        _check_no_parameter_in_two_units(self.ctx.all_states)

    def _cast_inputs(self, args, kwargs):
        policy = self.mp_policy
        if not (policy.cast_forward_inputs and policy.param_dtype is not None):
            return args, kwargs
        with record_function("FSDP::cast_forward_inputs"):
            return tree.map_tensors((args, kwargs), lambda x: _cast(policy.param_dtype, x))

    def _cast_output(self, output):
        if self.mp_policy.output_dtype is None:
            return output
        with record_function("FSDP::cast_forward_outputs"):
            return tree.map_tensors(output, lambda x: _cast(self.mp_policy.output_dtype, x))

    def _root_pre_forward(self) -> None:
        self._lazy_init()
        if self.ctx.iter_forward_root is None:
            self.ctx.iter_forward_root = self
            self.ctx.profiling = profiling.recording()  # once a forward, for every unit
            with record_function("FSDP::root_pre_forward"):
                pass  # (torch orders its streams here, on a GPU)

    def _pre_forward(self, module, args, kwargs):
        if self.training_state is TrainingState.PRE_BACKWARD:  # recomputed in backward
            if self.group is not None and not self.group.is_unsharded:
                self.group.unshard()
                self.group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first_in_pass = self.training_state is not TrainingState.FORWARD  # not from itself
        if first_in_pass:
            self._root_pre_forward()
        self.training_state = TrainingState.FORWARD
        args, kwargs = self._cast_inputs(args, kwargs)
        if self.group is not None:
            args, kwargs = self.group.pre_forward(args, kwargs)
        for target in self.forward_prefetch if first_in_pass else ():
            if target.group is not None:
                target.group.prefetch("forward")
        return args, kwargs

    def _post_forward(self, module, args, output):
        if self.training_state is TrainingState.PRE_BACKWARD:  # recomputed in backward
            return self._cast_output(output)
        if self.group is not None:
            self.group.post_forward()
        if torch.is_grad_enabled():
            for tensor in tree.grad_tensors(output):
                tensor.register_hook(self._pre_backward)
        self.training_state = TrainingState.IDLE
        if self.ctx.iter_forward_root is self:
            self.ctx.iter_forward_root = None
        return self._cast_output(output)

    def _pre_backward(self, grad):
        self.training_state = TrainingState.PRE_BACKWARD
        if not self.ctx.callback_queued:
            self.ctx.callback_queued = True
            self.ctx.profiling = profiling.recording()  # once a backward
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if self.group is not None:
            self.group.pre_backward(default_prefetch=not self.backward_prefetch)
        for target in self.backward_prefetch:
            if target.group is not None:
                target.group.prefetch("backward")
        return grad

    def _finish_backward(self) -> None:
        """End of backward: the post-backward of every unit that autograd did not reach through
        its inputs (or never reached), then every unit back to idle."""
        self.ctx.iter_forward_root = None
        for state in self.ctx.all_states:
            group = state.group
            if group is not None:
                if group.training_state is not TrainingState.POST_BACKWARD:
                    group.post_backward()
                group.training_state = TrainingState.IDLE
                group.gathered = None  # prefetched for a backward that did not come
                if self.ctx.is_last_backward:
                    group.post_forward_indices.clear()
            state.training_state = TrainingState.IDLE
        if self.ctx.is_last_backward:  # (False: a later backward prefetches by this order)
            self.ctx.post_forward_order.clear()
        self.ctx.callback_queued = False

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: every unit under this root resharded and
        idle, and what the step had begun dropped (gathered rows, gradients not yet reduced,
        HSDP's partial sums, the forward order), as torch's ``reset_iter_state``."""
        if self.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module (the "
                               "module the outermost fully_shard was applied to)")
        for state in self.ctx.all_states or [self]:
            group = state.group
            if group is not None:
                group.gathered, group.partial = None, None
                group.post_forward_indices.clear()
                group.training_state = TrainingState.IDLE
                group.reshard()
                for p in group.params:
                    p.take_unsharded_grad()
            state.training_state = TrainingState.IDLE
        self.ctx.post_forward_order.clear()
        self.ctx.iter_forward_root = None
        self.ctx.callback_queued = False


def _check_no_parameter_in_two_units(states: list[FSDPState]) -> None:
    """A parameter tied across two units (``head.weight = embed.weight`` with ``embed`` a unit
    and ``head`` in another) would be sharded twice: refused, as torch refuses it."""
    seen: dict[int, str] = {}
    for state in states:
        for p in state.group.params if state.group is not None else ():
            if p.uid in seen:
                raise ValueError(
                    f"parameter {p.fqn!r} is also parameter {seen[p.uid]!r} of another "
                    "fully_shard unit: a tied parameter must belong to one unit. Apply "
                    "fully_shard to a module that holds both uses, or to neither user alone.")
            seen[p.uid] = p.fqn
