"""The hooks that move a ``fully_shard`` unit through forward and backward.

* forward pre-hook: the first unit to run a forward becomes the *root* (as in torch, whatever the
  user passed, the root keeps its parameters gathered from forward to backward: it is needed
  again first); then cast the inputs to the compute dtype and gather the parameters;
* forward hook: free the parameters (``reshard_after_forward``), and hook every output that
  needs a gradient: the first gradient to reach an output gathers the parameters again
  (the pre-backward);
* post-backward: when the last of the unit's parameter gradients has been accumulated
  (``register_post_accumulate_grad_hook``), reduce-scatter them (``ParamGroup``). A unit some of
  whose parameters got no gradient in this backward is finished by a callback that the autograd
  engine runs at the end of the backward (queued by the first hook of that backward).

Torch reaches its post-backward through an autograd function on the module's inputs instead; the
moment differs, the arithmetic does not.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from miniddp.fsdp.param_group import ParamGroup


def _cast(dtype, x):
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
        return x.to(dtype)
    return x


class FSDPState:
    """One ``fully_shard`` call: its module, its parameter group (if it has parameters), its
    mixed-precision policy, and, on the root, the units still waiting for their post-backward."""

    def __init__(self, module, group: ParamGroup | None, mp_policy, reshard_after_forward):
        self.module, self.group, self.mp_policy = module, group, mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.root: FSDPState | None = None
        self.waiting: list[FSDPState] = []  # on the root: units to finish in this backward
        self.callback_queued = False
        if group is not None:
            group.on_all_gradients = self._all_gradients_arrived
        self.pending_backward = False
        module.register_forward_pre_hook(self.pre_forward, with_kwargs=True)
        module.register_forward_hook(self.post_forward)

    def _lazy_init(self) -> None:
        """The first unit to run a forward is the root of every unit below it."""
        for sub in self.module.modules():
            state = getattr(sub, "_fsdp_state", None)
            if state is not None and state.root is None:
                state.root = self
        if self.group is not None and self.reshard_after_forward is not False:
            self.group.reshard_after_forward = False

    def pre_forward(self, module, args, kwargs):
        if self.root is None:
            self._lazy_init()
        policy = self.mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args = tree_map(lambda x: _cast(policy.param_dtype, x), args)
            kwargs = tree_map(lambda x: _cast(policy.param_dtype, x), kwargs)
        if self.group is not None:
            self.group.unshard()
            if torch.is_grad_enabled() and not self.pending_backward:
                self.pending_backward = True
                self.root.waiting.append(self)
        return args, kwargs

    def post_forward(self, module, args, output):
        if self.group is not None and (self.group.reshard_after_forward
                                       or not torch.is_grad_enabled()):
            self.group.reshard()
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._pre_backward)
        if self.mp_policy.output_dtype is not None:
            output = tree_map(lambda x: _cast(self.mp_policy.output_dtype, x), output)
        return output

    def _pre_backward(self, grad):
        self._queue_final_callback()
        if self.group is not None and self.pending_backward:
            self.group.unshard()
        return grad

    def _queue_final_callback(self) -> None:
        root = self.root
        if not root.callback_queued:
            root.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._finish_backward)

    def _all_gradients_arrived(self) -> None:
        self._queue_final_callback()
        self.post_backward()

    def post_backward(self) -> None:
        if self.pending_backward:
            self.pending_backward = False
            self.group.reduce_gradients()

    def _finish_backward(self) -> None:
        """End of backward: finish the units whose gradients did not all arrive."""
        waiting, self.waiting = self.waiting, []
        self.callback_queued = False
        for state in reversed(waiting):
            state.post_backward()
