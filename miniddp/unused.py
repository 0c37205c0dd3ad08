"""Finding parameters that take no part in this step's loss (``find_unused_parameters``).

A parameter the loss does not depend on gets no gradient, so its hook never fires and its
bucket would wait forever. Two cases, as in torch's DDP:

* no output of forward reaches it: found at the end of forward by walking the autograd graph
  from the outputs (:func:`unreached_parameters`), and marked ready at the first hook;
* only outputs that the loss ignores reach it: nobody can know that before backward. The outputs
  are returned wrapped in an identity autograd function (:func:`watch_outputs`) whose backward,
  the first step of every backward through them, schedules a sweep for the end of backward that
  marks whatever is still not ready (torch's ``DDPSink`` plays this part).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def unreached_parameters(params: list[torch.Tensor], grad_fns) -> list[int]:
    """Indices of ``params`` that the autograd graphs below ``grad_fns`` do not reach."""
    stack = [fn for fn in grad_fns if fn is not None]
    seen, reached = set(stack), set()
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            reached.add(id(variable))
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                stack.append(next_node)
    return [i for i, p in enumerate(params) if id(p) not in reached]


def output_grad_fns(outputs) -> list:
    """The autograd nodes of every tensor in a (nested) forward output."""
    leaves, _ = tree_flatten(outputs)
    return [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def watch_outputs(outputs, at_end_of_backward: Callable[[], None]):
    """``outputs`` with every tensor that has a grad_fn passed through :class:`_WatchOutputs`."""
    leaves, spec = tree_flatten(outputs)
    tracked = [k for k, t in enumerate(leaves)
               if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not tracked:
        return outputs
    watched = _WatchOutputs.apply(at_end_of_backward, *(leaves[k] for k in tracked))
    for k, t in zip(tracked, watched):
        leaves[k] = t
    return tree_unflatten(leaves, spec)


class _WatchOutputs(torch.autograd.Function):
    """Identity on forward's outputs; its backward queues ``at_end_of_backward``."""

    @staticmethod
    def forward(ctx, at_end_of_backward, *outputs):
        ctx.at_end_of_backward = at_end_of_backward
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.at_end_of_backward)
        return (None, *grads)
