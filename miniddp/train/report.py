"""What the reference job prints: lines from rank 0 only, and losses averaged over every rank.

* Only rank 0 prints (:func:`print0`); N ranks printing the same line teach nothing.
* A printed loss is the mean over all ranks (:func:`mean_over_ranks`): rank 0's own loss is the
  loss of a quarter of the batch on four ranks, and looks better or worse than training really is.

The lessons print the same way (``course/report.py`` adds their checks, progress and pictures).
:func:`mean_over_ranks` is a collective: when a process group exists every rank must call it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from miniddp.launch import rank_device


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_main() -> bool:
    """True on rank 0, and in a process with no process group (then it is the only one).

    Outside a group torchrun's ``RANK`` decides, so code that runs after ``launch`` returns
    prints once under torchrun too.
    """
    if _in_group():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only, flushed at once so lines from forked ranks arrive in order."""
    if is_main():
        print(*args, **kwargs, flush=True)


def mean_over_ranks(value: float | torch.Tensor) -> float:
    """The mean of ``value`` over every rank (one all_reduce); ``value`` itself without a group."""
    t = torch.as_tensor(value).detach().to(torch.float64)
    if _in_group():
        t = t.to(rank_device())
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()
