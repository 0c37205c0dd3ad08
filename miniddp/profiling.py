"""Named spans in torch.profiler's traces, and nothing at all when no profiler records.

A user who profiles a step sees torch's own work (``c10d::allreduce_``, ``aten::mul``) and,
with these spans around it, which of miniddp's steps it belongs to: a ZeRO broadcast of rank
1's share, a bucket's launch. Asking torch whether a profiler records is cheap but not free, so
a step asks once and passes the answer on::

    on = profiling.recording()              # once per step
    for bucket in buckets:
        with profiling.span(on and f"miniddp.zero.broadcast rank {r} ({n} bytes)"):
            ...

``span`` of a false value is one shared, do-nothing context manager, and ``on and f"..."``
formats no name: without a profiler a step pays one check and a few ``with`` statements.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.profiler import record_function

_NO_SPAN = contextlib.nullcontext()


def recording() -> bool:
    """Whether a profiler records in this process now (ask once per step, not per tensor)."""
    return torch.autograd._profiler_enabled()


def span(name: str | bool | None):
    """``record_function(name)``: a span named ``name`` in the profiler's trace; nothing when
    ``name`` is false (no profiler recording)."""
    return record_function(name) if name else _NO_SPAN
