"""The reducer's errors: what went wrong in a backward, and what to do about it.

Kept apart from ``miniddp.reducer`` so that the core path reads in one sitting; each function
returns the exception for the reducer to raise.
"""

from __future__ import annotations

import torch.distributed as dist


def unfinished_reduction(reducer) -> RuntimeError:
    """A forward began while the last synchronized backward never reduced every parameter."""
    missing = [reducer.names[i] for i in range(len(reducer.params)) if i not in reducer.ready]
    if reducer.static_graph is not None:
        advice = reducer.static_graph.changed_graph_advice
    elif reducer.find_unused:
        advice = ("find_unused_parameters=True is set, so probably not every output of "
                  "forward was used to compute the loss: use them all, or return only "
                  "what the loss needs.")
    else:
        advice = ("If some parameters legitimately take no part in the loss, pass "
                  "find_unused_parameters=True to DistributedDataParallel; otherwise make "
                  "sure every output of forward contributes to the loss.")
    return RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a new "
        f"one: rank {dist.get_rank()} got no gradient in the last backward for these "
        f"parameters: {', '.join(missing)}. {advice}")


def marked_ready_twice(name: str) -> RuntimeError:
    return RuntimeError(
        f"parameter {name!r} was marked ready twice in one backward. Is it used outside "
        "forward, or in two reentrant backward passes (e.g. checkpointing the same layer "
        "twice)? For the latter, and if the graph is the same every iteration, pass "
        "static_graph=True.")


def higher_order_gradient(name: str) -> RuntimeError:
    return RuntimeError(
        f"the gradient of {name!r} requires grad: backward(create_graph=True) is not "
        "supported (torch's DDP fails here too; it never synchronizes higher-order "
        "gradients). For a gradient penalty, take the inner gradient with "
        "torch.autograd.grad(..., create_graph=True) and call loss.backward() plainly.")
