"""Copying and pickling a DDP model: ``copy.deepcopy(ddp)`` (an EMA model), ``pickle``.

A process group cannot be pickled, and a reducer's hooks belong to the parameters it was built
for. So, as torch's DDP does, a copy leaves out the process group and the reducer; when it is
restored it takes the default process group of the process it is restored in (its
``process_group``, as torch's copy's, is that group, never ``None``) and builds a fresh reducer
for its own parameters (iteration 0's buckets, rebuilt after the copy's first synchronized
backward, like a new DDP's) and a new logger. Nothing is broadcast: on each rank the copy is
what the original was. Only a DDP on the default process group can be copied (torch's rule
too): a restored copy could not know which group it belonged to.
"""

from __future__ import annotations

from torch import nn

from miniddp.compat.arguments import is_default_group
from miniddp.compat.logging_data import DDPLogging
from miniddp.options.gradient_views import GradientsAsBucketViews


def state_to_copy(ddp) -> dict:
    """``ddp.__getstate__``: everything but the reducer and the process group."""
    if not is_default_group(ddp.process_group):
        raise RuntimeError(
            "copying or pickling a DistributedDataParallel model works only on the default "
            "process group (as in torch), and this one was built with process_group="
            f"{ddp.process_group!r}. Copy or save ddp.module instead, and wrap the copy in "
            "its own DistributedDataParallel.")
    state = dict(ddp.__dict__)
    del state["reducer"], state["logger"]  # (the copy gets its own: see restore_copy)
    state["_group"] = None  # the default group, wherever the copy is restored
    return state


def restore_copy(ddp, state: dict) -> None:
    """``ddp.__setstate__``: the state back, the default process group (as torch's copy takes
    it), and a new reducer for the copy's parameters, with a new logger (the copy's
    ``_get_ddp_logging_data()`` counts its own iterations from 0, as torch's copy does)."""
    nn.Module.__setstate__(ddp, state)
    views = GradientsAsBucketViews() if ddp.gradient_as_bucket_view else None
    ddp.reducer = ddp._make_reducer(views, ddp.batched_grad_copy)
    ddp._attach_options(ddp.reducer)
    ddp.logger = DDPLogging(ddp)
    if ddp.static_graph:
        ddp.logger.set_static_graph()
