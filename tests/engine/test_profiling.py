"""miniddp in torch.profiler's traces: named spans while a profiler records, nothing otherwise.

A ZeRO step profiled on 2 ranks, exported with torch's own ``export_chrome_trace`` and read
back as a user's tools read it: the local step, each rank's broadcasts (named with the rank,
the tensor and its bytes, each holding torch's own broadcast op) and the wait, in that order;
with ``overlap_with_ddp``, bucket by bucket inside DDP's backward.
Without a profiler: one check per step, and no span made.
"""

import json
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from miniddp import DistributedDataParallel, profiling
from miniddp.optim import ZeroRedundancyOptimizer, hook_with_zero_step_interleaved
from miniddp.options import comm_hooks


def zero_after_backward(bucket_view: bool) -> ZeroRedundancyOptimizer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                   parameters_as_bucket_view=bucket_view)
    model(torch.randn(5, 8)).sum().backward()
    return zero


def expected_spans(zero: ZeroRedundancyOptimizer) -> list[str]:
    """The spans one step should show, from the partition: who sends what, how many bytes."""
    broadcasts = []
    for rank, groups in enumerate(zero._partition_parameters()):
        shares = [p for g in groups for p in g["params"]]
        sizes = ([sum(p.numel() * p.element_size() for p in shares if p.requires_grad) or 4]
                 if zero.parameters_as_bucket_view else
                 [p.numel() * p.element_size() for p in shares])
        broadcasts += [f"miniddp.zero.broadcast rank {rank} tensor {k} ({n} bytes)"
                       for k, n in enumerate(sizes)]
    return ([f"miniddp.zero.local_step rank {zero.rank}", *broadcasts,
             f"miniddp.zero.wait {len(broadcasts)} broadcasts"])


def zero_spans(events: list[dict]) -> list[dict]:
    return sorted((e for e in events if e["name"].startswith("miniddp.zero.")),
                  key=lambda e: e["ts"])


def exported_spans(prof, out_dir: str) -> list[dict]:
    """The complete events ('X') of torch's own Chrome trace of ``prof``, read back."""
    path = f"{out_dir}/zero-rank{dist.get_rank()}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def profiled_step(bucket_view: bool, out_dir: str) -> dict:
    zero = zero_after_backward(bucket_view)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        zero.step()
    events = exported_spans(prof, out_dir)
    ours = zero_spans(events)
    torchs_broadcasts = [e for e in events if e["name"] == "c10d::broadcast_"]
    holding = [any(s["ts"] <= b["ts"] and b["ts"] + b["dur"] <= s["ts"] + s["dur"]
                   for b in torchs_broadcasts)
               for s in ours if ".broadcast " in s["name"]]
    return {"spans": [e["name"] for e in ours], "expected": expected_spans(zero),
            "holding_torchs_broadcast": holding}


@pytest.mark.parametrize("bucket_view", [False, True])
def test_a_profiled_zero_step_shows_its_local_step_broadcasts_and_wait_in_order(
        ranks, tmp_path, bucket_view):
    for rank, seen in enumerate(ranks(2).run(profiled_step, bucket_view, str(tmp_path))):
        assert seen["spans"] == seen["expected"], f"rank {rank}"
        assert len(seen["spans"]) > 3 and all(seen["holding_torchs_broadcast"]), (rank, seen)


def profiled_overlapped_backward(out_dir: str) -> dict:
    """ZeRO stepping inside DDP's backward, bucket by bucket (interleaved): the fourth
    backward profiled (the first three set it up)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                           nn.Linear(16, 4))
    ddp = DistributedDataParallel(module, bucket_cap_mb=0.0001)  # a bucket per layer
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1,
                                   overlap_with_ddp=True)
    ddp.register_comm_hook(None, hook_with_zero_step_interleaved(comm_hooks.allreduce, ddp, zero))
    for step in range(4):
        with profile(activities=[ProfilerActivity.CPU]) if step == 3 else nullcontext() as prof:
            ddp(torch.randn(5, 8)).sum().backward()
    overlap, rank, expected = zero._overlap, zero.rank, []
    for index, owners in enumerate(overlap.owners):
        expected += [f"miniddp.zero.local_step rank {rank} bucket {index}"] * (rank in owners)
        for owner in sorted(owners):
            t = overlap.shares[owner][index].tensor
            expected.append(f"miniddp.zero.broadcast rank {owner} bucket {index} "
                            f"({t.numel() * t.element_size()} bytes)")
    expected.append(f"miniddp.zero.wait {len(overlap.owners)} broadcasts")
    return {"spans": [e["name"] for e in zero_spans(exported_spans(prof, out_dir))],
            "expected": expected}


def test_zero_overlapped_with_ddp_shows_each_buckets_step_and_broadcast_in_order(ranks,
                                                                                  tmp_path):
    for rank, seen in enumerate(ranks(2).run(profiled_overlapped_backward, str(tmp_path))):
        local_steps = (2, 1)[rank]  # 3 buckets: rank 0 owns 0 and 2, rank 1 owns 1
        assert len(seen["expected"]) == local_steps + 3 + 1, seen["expected"]
        assert seen["spans"] == seen["expected"], f"rank {rank}"


def unprofiled_step() -> dict:
    """Counts, in one step without a profiler: questions asked, spans made."""
    zero = zero_after_backward(bucket_view=False)
    asked, made = [], []
    recording, record_function = profiling.recording, profiling.record_function
    profiling.recording = lambda: asked.append(1) or recording()
    profiling.record_function = lambda name: made.append(name) or record_function(name)
    try:
        zero.step()
    finally:
        profiling.recording, profiling.record_function = recording, record_function
    return {"asked": len(asked), "made": made}


def test_without_a_profiler_a_step_asks_once_and_makes_no_span(ranks):
    assert ranks(2).run(unprofiled_step) == [{"asked": 1, "made": []}] * 2


def test_span_is_record_function_only_when_named():
    assert profiling.span(False) is profiling.span(None) is profiling.span("")
    assert isinstance(profiling.span("x"), profiling.record_function)
    assert not profiling.recording()
    with profile(activities=[ProfilerActivity.CPU]):
        assert profiling.recording()


# ----- DDP: the reducer's steps as spans -----

def ddp_spans(events: list[dict]) -> list[dict]:
    return sorted((e for e in events if e["name"].startswith("miniddp.ddp.")),
                  key=lambda e: e["ts"])


def inside(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def profiled_ddp_steps(out_dir: str) -> dict:
    """A DDP of three buckets: the second step (the one that rebuilds the buckets) and the
    third profiled, each exported with torch's ``export_chrome_trace``."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                           nn.Linear(16, 4))
    ddp = DistributedDataParallel(module, bucket_cap_mb=0.0001)  # a bucket per layer
    seen = {}
    for step in range(3):
        with profile(activities=[ProfilerActivity.CPU]) if step else nullcontext() as prof:
            ddp(torch.randn(5, 8)).sum().backward()
        if step:
            events = exported_spans(prof, out_dir)
            seen[step] = {"spans": ddp_spans(events),
                          "allreduces": [e for e in events if e["name"] == "c10d::allreduce_"]}
    buckets = [f" bucket {b.index} ({len(b.param_indices)} tensors, {b.nbytes} bytes)"
               for b in ddp.buckets]
    return {"seen": seen, "buckets": buckets}


def test_a_profiled_ddp_step_shows_each_buckets_copy_launch_wait_and_write_back(ranks, tmp_path):
    for rank, result in enumerate(ranks(2).run(profiled_ddp_steps, str(tmp_path))):
        buckets, step = result["buckets"], result["seen"][2]
        assert len(buckets) == 3
        names = [s["name"] for s in step["spans"]]
        assert names[0] == "miniddp.ddp.forward", (rank, names)
        for kind in ("copy_in", "launch", "wait", "write_back"):  # every bucket, in order
            assert [n for n in names if n.startswith(f"miniddp.ddp.{kind} ")] == [
                f"miniddp.ddp.{kind}{b}" for b in buckets], (rank, kind, names)
        spans = {s["name"]: s for s in step["spans"]}
        end = spans["miniddp.ddp.end_of_backward"]
        for b in buckets:
            launch, wait = spans[f"miniddp.ddp.launch{b}"], spans[f"miniddp.ddp.wait{b}"]
            assert spans[f"miniddp.ddp.copy_in{b}"]["ts"] <= launch["ts"] < end["ts"]
            assert inside(wait, end) and inside(spans[f"miniddp.ddp.write_back{b}"], end)
            assert wait["ts"] < spans[f"miniddp.ddp.write_back{b}"]["ts"]
            assert any(inside(a, launch) for a in step["allreduces"]), (rank, b)
        rebuilt = [s["name"] for s in result["seen"][1]["spans"]]
        assert "miniddp.ddp.rebuild" in rebuilt and "miniddp.ddp.rebuild" not in names


def unprofiled_ddp_steps() -> dict:
    """Questions asked and spans made over three steps of a 40-parameter DDP, no profiler."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)]),
                                  bucket_cap_mb=0)  # a bucket per parameter
    asked, made = [], []
    recording, record_function = profiling.recording, profiling.record_function
    profiling.recording = lambda: asked.append(1) or recording()
    profiling.record_function = lambda name: made.append(name) or record_function(name)
    try:
        for _ in range(3):
            ddp(torch.randn(2, 4)).sum().backward()
    finally:
        profiling.recording, profiling.record_function = recording, record_function
    return {"asked": len(asked), "made": made}


def test_without_a_profiler_a_ddp_step_asks_twice_whatever_its_size(ranks):
    """At the forward, and once for the reducer's step: not per gradient or bucket."""
    assert ranks(2).run(unprofiled_ddp_steps) == [{"asked": 6, "made": []}] * 2
