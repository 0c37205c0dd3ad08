"""Every rank's backward in one picture: the reducer's events as a Chrome trace (the JSON "Trace
Event Format"), which Perfetto (https://ui.perfetto.dev) and chrome://tracing open.

``ddp.reducer.timeline`` and ``ddp.trace()`` record what one rank's reducer did. A slow or
stuck step is usually about the ranks together: which rank's gradients came late, which
all_reduce waited for whom. So every rank calls (a collective, on ``group``)::

    ddp.reducer.timeline = []
    loss.backward()
    save_chrome_trace("step.json", ddp.reducer.timeline, ddp.buckets)   # or a ddp.trace()

and group rank 0 writes one file, each rank a process of its own ("rank r") with these tracks:

* ``backward``: a mark for each gradient ready (its parameter, its bucket), a span while the
  gradients arrive (the first ready to the last one computed, "backward end"), then a span for
  the end-of-backward callback (to "finalized": ``loss.backward()`` returns), with a mark for
  each bucket waited for;
* ``all_reduce``: a span per bucket from its launch to gloo's thread recording it done. All
  that are in flight at once cannot share a track (a track's spans must nest, as calls do), so
  overlapping ones go on ``all_reduce 2``, ``3`` ... as needed.

Clocks: each process records ``time.perf_counter()``, which counts from a different moment in
each process (and on each machine). The ranks align at a barrier: right after it, each reads
its clock, and every time is taken relative to that reading, so the ranks share one zero up to
how far apart they left the barrier (about one message's latency). The trace's times are
microseconds from the earliest event of any rank.

Only the event records (``(event, ident, time)``, :data:`miniddp.reducer.EVENTS`) and the
buckets' public description (``ddp.buckets``) are read; an event this module does not know is
a mark named after it.
"""

from __future__ import annotations

import json
import os
import time

import torch.distributed as dist

from miniddp.checks.trace import BackwardTrace

#: What a rank sends: (rank, records with times relative to the barrier, its buckets).
Sent = tuple[int, list[tuple[str, int, float]], list]


def chrome_trace(events, buckets=(), group=None) -> dict:
    """Every rank's ``events`` as one Chrome trace, returned on every rank of ``group`` (a
    collective). ``events``: the records of ``ddp.reducer.timeline``, or a ``ddp.trace()``
    (which brings its buckets); ``buckets``: ``ddp.buckets``, which names the parameters."""
    if events is None:  # (on every rank alike, as the timeline is set on every rank)
        raise ValueError("no events: set ddp.reducer.timeline = [] before the step to record it")
    records = list(events) if not isinstance(events, BackwardTrace) else [
        (e, i, events.start + t) for e, i, t in events.events]  # a trace's: since its start
    buckets = buckets or getattr(events, "buckets", ())
    dist.barrier(group=group)
    zero = time.perf_counter()
    mine: Sent = (dist.get_rank(group), [(e, i, t - zero) for e, i, t in records], list(buckets))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return trace_of(everyone)


def save_chrome_trace(path, events, buckets=(), group=None) -> dict:
    """:func:`chrome_trace`, written to ``path`` by the group's rank 0; returned everywhere."""
    trace = chrome_trace(events, buckets, group)
    if dist.get_rank(group) == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace


def trace_of(ranks: list[Sent]) -> dict:
    """The Chrome trace (JSON object format) of every rank's records, times in seconds on one
    clock; microseconds in the trace, from the earliest record."""
    times = [t for _, records, _ in ranks for _, _, t in records]
    origin = min(times, default=0.0)
    events = []
    for rank, records, buckets in ranks:
        us = [(e, i, round(1e6 * (t - origin), 3))
              for e, i, t in sorted(records, key=lambda record: record[2])]
        events += _rank_events(rank, us, buckets)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "miniddp.checks.chrome_trace",
                          "clocks": "ranks aligned at a barrier; microseconds from the "
                                    "earliest event"}}


def _rank_events(rank: int, records: list, buckets: list) -> list[dict]:
    spans, lanes_needed = _all_reduce_spans(records, buckets, rank)
    events = [_meta(rank, 0, "process_name", name=f"rank {rank}"),
              _meta(rank, 0, "process_sort_index", sort_index=rank),
              _meta(rank, 0, "thread_name", name="backward"),
              _meta(rank, 0, "thread_sort_index", sort_index=0)]
    for lane in range(1, lanes_needed + 1):
        name = "all_reduce" if lane == 1 else f"all_reduce {lane}"
        events += [_meta(rank, lane, "thread_name", name=name),
                   _meta(rank, lane, "thread_sort_index", sort_index=lane)]
    return events + _backward_track(records, buckets, rank) + spans


def _all_reduce_spans(records: list, buckets: list, rank: int) -> tuple[list[dict], int]:
    """A span per bucket from launch to done; taken in launch order, each on the first lane
    whose spans have all ended by its launch. A launch never done is a mark."""
    launched, found, spans = {}, [], []
    for event, ident, t in records:
        if event == "launch":
            if ident in launched:  # the last one never done
                spans.append(_mark(rank, f"launch bucket {ident}, never done", launched[ident]))
            launched[ident] = t
        elif event == "done" and ident in launched:
            found.append((launched.pop(ident), t, ident))
    spans += [_mark(rank, f"launch bucket {i}, never done", t) for i, t in launched.items()]
    lane_ends = []  # the end of each lane's last span
    for start, end, ident in sorted(found):
        lane = next((k for k, last in enumerate(lane_ends) if last <= start), len(lane_ends))
        lane_ends[lane:lane + 1] = [end]  # (a new lane when every one is busy)
        spans.append(_span(rank, lane + 1, f"all_reduce bucket {ident}", start, end,
                           **_bucket_args(buckets, ident)))
    return spans, len(lane_ends)


def _backward_track(records: list, buckets: list, rank: int) -> list[dict]:
    """Marks for the gradients, the end of backward and the waits; a span for the gradients
    arriving and one for the callback, step by step."""
    names = {i: (name, b.index) for b in buckets for i, name in zip(b.param_indices, b.names)}
    events, first_ready, ended = [], None, None
    for event, ident, t in records:
        if event == "ready":
            name, bucket = names.get(ident, (f"parameter {ident}", None))
            events.append(_mark(rank, f"ready {name}", t, parameter=name, index=ident,
                                bucket=bucket))
            first_ready = t if first_ready is None else first_ready
        elif event == "backward_end":
            if first_ready is not None:
                events.append(_span(rank, 0, "gradients arriving", first_ready, t))
            events.append(_mark(rank, "backward end", t))
            first_ready, ended = None, t
        elif event == "waited":
            events.append(_mark(rank, f"waited bucket {ident}", t, bucket=ident))
        elif event == "finalized":
            if ended is not None:
                events.append(_span(rank, 0, "end of backward: wait, write back", ended, t))
            events.append(_mark(rank, "finalized", t))
            ended = None
        elif event not in ("launch", "done"):  # (those are the all_reduce tracks')
            events.append(_mark(rank, f"{event} {ident}", t, ident=ident))
    return events


def _bucket_args(buckets: list, index: int) -> dict:
    found = [b for b in buckets if b.index == index]
    if not found:
        return {"bucket": index}
    b = found[0]
    return {"bucket": index, "tensors": len(b.param_indices), "bytes": b.nbytes,
            "parameters": list(b.names)}


def _meta(pid: int, tid: int, what: str, **args) -> dict:
    return {"ph": "M", "name": what, "pid": pid, "tid": tid, "ts": 0, "args": args}


def _mark(pid: int, name: str, ts: float, **args) -> dict:
    return {"ph": "i", "s": "t", "name": name, "cat": "miniddp", "pid": pid, "tid": 0,
            "ts": ts, "args": args}


def _span(pid: int, tid: int, name: str, start: float, end: float, **args) -> dict:
    return {"ph": "X", "name": name, "cat": "miniddp", "pid": pid, "tid": tid, "ts": start,
            "dur": round(end - start, 3), "args": args}
