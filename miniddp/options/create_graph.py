"""``loss.backward(create_graph=True)`` through DDP: reduce the gradient's value, warn.

Where a gradient penalty or a second-order method builds a graph of the gradient itself, each
``.grad`` that reaches the reducer requires grad. torch's DDP warns that the higher-order
gradient is not synchronized, averages the gradient's *value* like any other (the bucket holds
no graph), and writes the average back into ``.grad`` in place, so the graph built on it stays
attached. miniddp does the same, in the three places where a gradient meets a bucket:

* copied in one by one: ``torch.mul(grad, r, out=view)`` refuses a gradient that requires
  grad while grad mode is on, so when it fails the reducer copies again inside
  :func:`value_only`;
* copied in with the rest of a complete bucket: the bucket keeps its value, detached
  (``Bucket.fill``);
* written back at the end of backward: :func:`write_back`, an in-place copy into the graph,
  with torch's warning.

The reducer pays nothing for this on a plain backward: the first path costs a ``try``, the
second a flag read per gradient in a bucket copied at once, the third the flag it reads anyway.
"""

from __future__ import annotations

import torch

from miniddp.errors import print_warning


def warn() -> None:
    """torch's warning, opening in torch's words, printed at every such backward as torch's
    reducer prints it (``miniddp.errors``: stderr, not a Python warning)."""
    print_warning(
        "Using DistributedDataParallel with create_graph=True is not well-supported. The "
        "higher-order gradient will not be synchronized across ranks, and backpropagation "
        "through all_reduce operations will not occur. For a gradient penalty, take the inner "
        "gradient with torch.autograd.grad(..., create_graph=True) and call loss.backward() "
        "plainly.")


def value_only(param: torch.Tensor, error: RuntimeError, grads_are_views: bool):
    """The reducer's copy of ``param.grad`` into its bucket raised ``error``: if that is
    because the gradient requires grad, return where to copy its value again (no grad mode);
    otherwise raise ``error`` again."""
    if (param.grad is None or not param.grad.requires_grad or grads_are_views
            or not torch.is_grad_enabled()):
        raise error
    return torch.no_grad()


def write_back(name: str, grad: torch.Tensor, average: torch.Tensor) -> None:
    """Copy the average into a gradient that requires grad, in place, as torch does, and warn
    as torch does for each such gradient."""
    warn()
    try:
        grad.copy_(average)
    except RuntimeError as error:
        raise RuntimeError(
            f"the gradient of {name!r} requires grad, and writing the average back into it "
            f"failed ({error}): backward(create_graph=True) works through DDP only where the "
            "gradient can be overwritten in place (torch's DDP fails here too; it never "
            "synchronizes higher-order gradients). For a gradient penalty, take the inner "
            "gradient with torch.autograd.grad(..., create_graph=True) and call "
            "loss.backward() plainly.") from None
