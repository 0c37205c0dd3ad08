"""FSDP's steps in torch.profiler's traces: torch's names, then the unit and its bytes.

While a profiler records, each FSDP step shows as torch names it (``FSDP::all_gather``, ...)
followed by the unit it works on and, for the collectives, the bytes
(``FSDP::all_gather (unit blocks.1, 2304 bytes)``), so that a user's grep for torch's name still
finds it. Read back from torch's own exported Chrome trace, at 2 ranks (FSDP) and at 2 x 2
(HSDP: the reduce holds the reduce-scatter and the all-reduce across the replicas). Without a
profiler: the names are torch's alone, and the question is asked twice a step (at the root's
forward and at the start of the backward), not at every unit.
"""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist
from test_fsdp import Case, Net, meshes, shard_model
from torch.profiler import ProfilerActivity, profile

import miniddp
from miniddp import profiling
from miniddp.fsdp import param_group

UNITS = {"blocks.0": ["blocks.0.lin.weight", "blocks.0.lin.bias"],
         "blocks.1": ["blocks.1.lin.weight", "blocks.1.lin.bias"],
         "blocks.2": ["blocks.2.lin.weight", "blocks.2.lin.bias"],
         "": ["head.weight", "head.bias"]}


def expected_bytes(shard_size: int) -> dict[str, int]:
    """Each unit's all-gather (and reduce-scatter) in fp32: every rank's rows of torch.chunk's
    cut, padded to chunk 0's, for each of its parameters."""
    shapes = {name: p.shape for name, p in Net().named_parameters()}
    return {unit: 4 * shard_size * sum(math.ceil(shapes[n][0] / shard_size) * shapes[n][1:].numel()
                                       for n in names) for unit, names in UNITS.items()}


def inside(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def profiled_step(out_dir: str, mesh: tuple[int, int] | None) -> dict:
    """The second step of test_fsdp's model (the first picks the root) under the profiler, as
    torch's exported trace holds it: the FSDP spans, and the collectives inside each."""
    torch.manual_seed(0)
    case = Case(mesh=mesh)
    our_mesh, _ = meshes(case)
    model = shard_model(Net(), miniddp.fully_shard, miniddp.MixedPrecisionPolicy(), case,
                        **({} if our_mesh is None else {"mesh": our_mesh}))
    model(torch.randn(4, 12)).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(4, 12)).sum().backward()
    path = f"{out_dir}/fsdp-rank{dist.get_rank()}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    spans = [e for e in events if e["name"].startswith("FSDP::")]
    collectives = [e for e in events if e["name"].startswith("c10d::")]
    return {"names": [e["name"] for e in spans],
            "inside": {e["name"]: sorted(c["name"] for c in collectives if inside(c, e))
                       for e in spans}}


def unit_name(unit: str) -> str:
    return f"unit {unit}" if unit else "root unit"


def check_names(seen: dict, shard_size: int, rank: int) -> None:
    names = set(seen["names"])
    for unit, nbytes in expected_bytes(shard_size).items():
        for step in ("all_gather", "all_gather_copy_out", "post_backward_reduce"):
            assert f"FSDP::{step} ({unit_name(unit)}, {nbytes} bytes)" in names, (rank, unit,
                                                                                 step, names)
        for step in ("pre_forward", "post_forward", "pre_backward"):
            assert f"FSDP::{step} ({unit_name(unit)})" in names, (rank, unit, step, names)
    unnamed = [n for n in names if "unit" not in n]
    assert unnamed == ["FSDP::root_pre_forward"], unnamed  # torch's, about no unit


def test_a_profiled_fsdp_step_names_each_unit_and_its_bytes(ranks, tmp_path):
    for rank, seen in enumerate(ranks(2).run(profiled_step, str(tmp_path), None)):
        check_names(seen, 2, rank)
        for name, held in seen["inside"].items():
            if name.startswith("FSDP::all_gather ("):
                assert len(held) == 1 and "allgather" in held[0], (rank, name, held)
            if name.startswith("FSDP::post_backward_reduce"):  # gloo: an all_reduce, then a slice
                assert held == ["c10d::allreduce_"], (rank, name, held)


def test_hsdp_names_hold_the_reduce_scatter_and_the_all_reduce_across_replicas(ranks, tmp_path):
    for rank, seen in enumerate(ranks(4).run(profiled_step, str(tmp_path), (2, 2))):
        check_names(seen, 2, rank)
        reduces = {n: h for n, h in seen["inside"].items() if "post_backward_reduce" in n}
        assert len(reduces) == 4 and all(h == ["c10d::allreduce_"] * 2
                                         for h in reduces.values()), (rank, reduces)


def unprofiled_steps(steps: int) -> dict:
    """Over ``steps`` steps without a profiler: how often whether one records was asked, and
    the names of the spans made."""
    torch.manual_seed(0)
    model = shard_model(Net(), miniddp.fully_shard, miniddp.MixedPrecisionPolicy(), Case())
    asked, named = [], []
    recording, record_function = profiling.recording, param_group.record_function
    profiling.recording = lambda: asked.append(1) or recording()
    param_group.record_function = lambda name: named.append(name) or record_function(name)
    try:
        for _ in range(steps):
            model(torch.randn(4, 12)).sum().backward()
    finally:
        profiling.recording, param_group.record_function = recording, record_function
    return {"asked": len(asked), "names": sorted(set(named))}


def test_without_a_profiler_a_step_asks_twice_and_names_spans_as_torch(ranks):
    for seen in ranks(2).run(unprofiled_steps, 3):
        assert seen["asked"] == 2 * 3
        assert seen["names"] == sorted(f"FSDP::{step}" for step in (
            "all_gather", "all_gather_copy_out", "backward_prefetch", "post_backward_reduce",
            "post_forward", "pre_backward", "pre_forward")), seen["names"]
