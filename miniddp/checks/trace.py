"""Watch one synchronized backward pass, event by event.

DDP's work happens inside ``loss.backward()``, where a learner cannot see it. The reducer can
record what it does (``ddp.reducer.timeline``: ``(event, index, time.perf_counter())``); this
module turns that record into lines a person can read::

    with miniddp.checks.trace.trace_backward(ddp) as trace:   # or: with ddp.trace() as trace:
        loss.backward()
    print(trace.format())

Each line is one event, with the milliseconds since the ``with`` began: a parameter's gradient
becoming ready (its name, the bucket it went into and how full that bucket now is), a bucket's
all_reduce launched, finished (recorded on gloo's communication thread), the end of backward
(the last gradient computed; the callback queued on the autograd engine starts), each bucket
waited for and its averages written into ``.grad``, and backward returning. ``all_ranks=True``
gathers every rank's trace (a collective: every rank must use it) and prints them side by side.

On a GPU the times are when the CPU launched the work (CUDA runs asynchronously); a profiler
shows when the GPU ran it. A parameter that ``find_unused_parameters`` marks ready without a
gradient has no line of its own.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from miniddp.buckets import BucketInfo

MIB = 2**20


@dataclass
class BackwardTrace:
    """One rank's events (times in seconds since the trace began, at ``start`` on this
    process's ``time.perf_counter()``) and the buckets they used."""

    rank: int = 0
    names: list[str] = field(default_factory=list)
    buckets: list[BucketInfo] = field(default_factory=list)
    events: list[tuple[str, int, float]] = field(default_factory=list)
    others: list[BackwardTrace] = field(default_factory=list)  # every rank's, with all_ranks
    start: float = 0.0

    def lines(self) -> list[str]:
        """The events in the order they were recorded, one readable line each."""
        bucket_of = {i: b for b in self.buckets for i in b.param_indices}
        filled = {b.index: 0 for b in self.buckets}
        lines = []
        for event, ident, t in self.events:
            if event == "ready":
                b = bucket_of[ident]
                filled[b.index] += 1
                what = (f"ready     {self.names[ident]} -> bucket {b.index} "
                        f"({filled[b.index]}/{len(b.param_indices)})")
            elif event == "launch":
                b = self.buckets[ident]
                what = (f"launch    bucket {ident}: all_reduce of {len(b.param_indices)} "
                        f"tensors, {b.nbytes / MIB:.2f} MiB")
            elif event == "done":
                what = f"done      bucket {ident}: all_reduce finished"
            elif event == "backward_end":
                what = "backward  last gradient computed; the queued callback runs"
            elif event == "waited":
                what = f"waited    bucket {ident}: its all_reduce is complete here"
            elif event == "finalized":
                what = "finalized the averages copied into .grad; backward() returns"
            else:
                what = f"{event} {ident}"
            lines.append(f"{1e3 * t:8.3f} ms  {what}")
        return lines

    LEGEND = ("(ms since each rank's own backward began; buckets may finish out of launch\n"
              " order, since gloo runs them on threads of its own; the averages are copied\n"
              " into .grad after the last wait, at 'finalized')")

    def format(self, side_by_side: bool = False) -> str:
        """This rank's trace, or, gathered with ``all_ranks``, every rank's: one after another,
        or ``side_by_side`` (rows paired by event number, not by time)."""
        if not self.others:
            return "\n".join([self.LEGEND, f"rank {self.rank}:"] + self.lines())
        if not side_by_side:
            return "\n".join([self.LEGEND] + [line for t in self.others
                                               for line in [f"rank {t.rank}:"] + t.lines()])
        columns = [[f"rank {t.rank}:"] + t.lines() for t in self.others]
        width = max(len(line) for column in columns for line in column)
        rows = max(len(column) for column in columns)
        table = ["  ".join(f"{(c[k] if k < len(c) else ''):<{width}}" for c in columns).rstrip()
                 for k in range(rows)]
        return "\n".join([self.LEGEND] + table)

    def count(self, event: str) -> int:
        return sum(e == event for e, _, _ in self.events)


@contextmanager
def trace_backward(ddp, all_ranks: bool = False):
    """Record what ``ddp``'s reducer does inside the ``with`` block; yield the trace.

    The trace is filled when the block ends. With ``all_ranks`` every rank gathers every rank's
    trace there (a collective: every rank must enter and leave the block).
    """
    reducer = ddp.reducer
    trace = BackwardTrace(rank=dist.get_rank(), names=list(reducer.names))
    before, reducer.timeline = reducer.timeline, []
    start = trace.start = time.perf_counter()
    try:
        yield trace
    finally:
        recorded, reducer.timeline = reducer.timeline, before
    trace.events = [(event, ident, t - start) for event, ident, t in recorded]
    trace.buckets = ddp.buckets
    if all_ranks:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, BackwardTrace(trace.rank, trace.names, trace.buckets,
                                                       trace.events, start=trace.start))
        trace.others = gathered
