"""miniddp.checks.trace: one backward, event by event, readable and in the order things happened."""

import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lesson_modules import LESSONS_DIR
from torch import nn
from warm_python import LESSON_PRELOAD, warm_python

import miniddp
from miniddp.checks.trace import trace_backward


class TwoLayers(nn.Module):
    """A user's own model, with names that are not a Sequential's numbers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.encoder(x)))


def traced_steps(steps: int, cap_mb=None):
    ddp = miniddp.DistributedDataParallel(TwoLayers(), bucket_cap_mb=cap_mb)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    traces = []
    for _ in range(steps):
        loss = F.mse_loss(ddp(x), y)
        with ddp.trace() as trace:
            loss.backward()
        traces.append(trace)
    return traces, ddp.reducer.timeline, [b.param_indices for b in ddp.buckets]


def without_times(lines):
    return [re.sub(r"^\s*[\d.]+ ms  ", "", line) for line in lines]


def test_first_backward_reads_event_by_event_with_names_and_fullness(ranks):
    for traces, timeline_after, _ in ranks(2).run(traced_steps, 1):
        lines = without_times(traces[0].lines())
        assert [line for line in lines if not line.startswith("done")] == [
            "ready     head.bias -> bucket 0 (1/4)",
            "ready     head.weight -> bucket 0 (2/4)",
            "ready     encoder.bias -> bucket 0 (3/4)",
            "ready     encoder.weight -> bucket 0 (4/4)",
            "launch    bucket 0: all_reduce of 4 tensors, 0.00 MiB",
            "backward  last gradient computed; the queued callback runs",
            "waited    bucket 0: its all_reduce is complete here",
            "finalized the averages copied into .grad; backward() returns",
        ]
        done = lines.index("done      bucket 0: all_reduce finished")
        assert lines.index("launch    bucket 0: all_reduce of 4 tensors, 0.00 MiB") < done
        assert done < lines.index("waited    bucket 0: its all_reduce is complete here")
        assert timeline_after is None  # the reducer's record is switched off again


def position(trace, event, ident):
    return next(k for k, (e, i, _) in enumerate(trace.events) if e == event and i == ident)


def test_rebuilt_buckets_fill_launch_and_finish_in_order(ranks):
    cap_mb = 500 / 2**20  # head (528 bytes) fills a bucket of its own from torch 2.4 on
    for traces, _, layout in ranks(2).run(traced_steps, 3, cap_mb):
        trace, lines = traces[-1], traces[-1].lines()
        kinds = [e for e, _, _ in trace.events]
        assert kinds[-1] == "finalized" and kinds.index("backward_end") < kinds.index("waited")
        assert [i for e, i, _ in trace.events if e == "launch"] == list(range(len(layout)))
        assert [i for e, i, _ in trace.events if e == "waited"] == list(range(len(layout)))
        for b, members in enumerate(layout):
            launched = position(trace, "launch", b)
            assert all(position(trace, "ready", i) < launched for i in members)
            assert launched < position(trace, "done", b) < position(trace, "waited", b)
            assert sum(f"-> bucket {b} ({len(members)}/{len(members)})" in line
                       for line in lines) == 1
            for i in members:
                assert sum(f"ready     {trace.names[i]} -> bucket {b} (" in line
                           for line in lines) == 1


def no_sync_trace():
    ddp = miniddp.DistributedDataParallel(TwoLayers())
    with ddp.no_sync():
        loss = F.mse_loss(ddp(torch.randn(8, 16)), torch.randn(8, 4))
        with trace_backward(ddp) as trace:
            loss.backward()
    return trace.lines()


def test_a_backward_inside_no_sync_shows_nothing_launched(ranks):
    assert ranks(2).run(no_sync_trace) == [[], []]


def every_rank(side_by_side):
    ddp = miniddp.DistributedDataParallel(TwoLayers())
    loss = F.mse_loss(ddp(torch.randn(8, 16) + dist.get_rank()), torch.randn(8, 4))
    with ddp.trace(all_ranks=True) as trace:
        loss.backward()
    return trace.format(side_by_side)


def test_all_ranks_one_after_another(ranks):
    lines = ranks(3).run(every_rank, False)[0].splitlines()
    legend = miniddp.checks.trace.BackwardTrace.LEGEND.splitlines()
    assert lines[:len(legend)] == legend
    starts = [lines.index(f"rank {r}:") for r in range(3)]
    assert starts == sorted(starts)
    for begin, end in zip(starts, starts[1:] + [len(lines)]):
        kinds = [line.split()[2] for line in lines[begin + 1:end]]
        assert kinds[0] == "ready" and kinds[-1] == "finalized"


def test_all_ranks_side_by_side(ranks):
    text = ranks(3).run(every_rank, True)[0]
    header = text.splitlines()[3]
    assert header.index("rank 0:") < header.index("rank 1:") < header.index("rank 2:")
    assert all(line.count("ready") == 3 for line in text.splitlines()[4:8])


@pytest.mark.lesson
def test_lesson_06_prints_the_trace_with_trace(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["MINIDDP_RUNS"] = str(tmp_path)
    # from an interpreter that has imported torch already, as tests/course/test_lessons.py runs
    # lessons
    done = warm_python(LESSON_PRELOAD).run(
        [sys.executable, str(LESSONS_DIR / "06_overlap.py"), "--trace"], env=env,
        cwd=LESSONS_DIR.parent, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    trace = done.stdout.split("event by event (--trace)")[1]
    assert "rank 0:" in trace and "rank 1:" in trace
    assert "ready     10.weight -> bucket 0 (2/" in trace
    assert "finalized the averages copied into .grad" in trace
