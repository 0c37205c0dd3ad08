"""miniddp.checks.chrome_trace: every rank's backward as one Chrome trace that Perfetto opens.

The JSON is held to the Trace Event Format (a small JSON Schema of the fields each phase
needs, the tracks named, spans on one track nesting as calls do), and the schema itself to
reality: torch.profiler's own exported trace passes it, and ours carries every field torch's
carries for the same phase, with the same JSON types. Then a real 2-rank step: each record of
each rank is in the trace, at its own time in microseconds, in the records' order; the ranks
share one zero even when their clocks do not. A broken exporter (seconds for microseconds,
one track for overlapping all_reduces, marks without a scope, no track names, no ``dur``) fails
the same checks.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import miniddp
from miniddp.buckets import BucketInfo
from miniddp.checks import chrome_trace
from miniddp.checks.chrome_trace import save_chrome_trace, trace_of

jsonschema = pytest.importorskip("jsonschema")

NUMBER, ID = {"type": "number"}, {"type": ["integer", "string"]}


def when(phases: list[str], then: dict) -> dict:
    return {"if": {"properties": {"ph": {"enum": phases}}, "required": ["ph"]}, "then": then}


#: The Trace Event Format's fields, phase by phase, as Perfetto and chrome://tracing read them.
EVENT = {
    "type": "object",
    "required": ["ph", "pid", "tid"],
    "properties": {"ph": {"type": "string"}, "name": {"type": "string"}, "cat": {"type": "string"},
                   "pid": ID, "tid": ID, "ts": NUMBER, "args": {"type": "object"}},
    "allOf": [
        when(["X"], {"required": ["name", "ts", "dur"],
                     "properties": {"dur": {"type": "number", "minimum": 0}}}),
        when(["B", "E"], {"required": ["ts"]}),
        when(["i", "I"], {"required": ["name", "ts", "s"],
                          "properties": {"s": {"enum": ["g", "p", "t"]}}}),
        when(["b", "e", "n", "s", "t", "f"], {"required": ["name", "ts", "id"]}),
        when(["C"], {"required": ["name", "ts", "args"]}),
        when(["M"], {"required": ["name", "args"], "properties": {"name": {"enum": [
            "process_name", "process_labels", "process_sort_index", "thread_name",
            "thread_sort_index"]}}}),
    ],
}
TRACE = {"type": "object", "required": ["traceEvents"],
         "properties": {"traceEvents": {"type": "array", "items": EVENT},
                        "displayTimeUnit": {"enum": ["ms", "ns"]}}}


def schema_problems(trace: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.path))}: {e.message}"
            for e in jsonschema.Draft7Validator(TRACE).iter_errors(trace)]


def nesting_problems(trace: dict, slack_us: float = 1e-3) -> list[str]:
    """Spans ('X') on one track that partially overlap (Perfetto cannot draw them as calls)."""
    tracks: dict = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    problems = []
    for track, spans in tracks.items():
        open_ends = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + slack_us:
                open_ends.pop()
            if open_ends and e["ts"] + e["dur"] > open_ends[-1] + slack_us:
                problems.append(f"{track}: {e['name']!r} overlaps the span it starts in")
            open_ends.append(e["ts"] + e["dur"])
    return problems


def naming_problems(trace: dict) -> list[str]:
    """Every process and every track used has a name: a metadata event, or an id that is a
    string (which viewers show as its name, as torch's "Spans" and "Traces")."""
    named = {(e["pid"], e["tid"] if e["name"] == "thread_name" else None)
             for e in trace["traceEvents"] if e["ph"] == "M" and "name" in e["args"]}
    used = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] != "M"}
    return ([f"process {pid} has no name" for pid in {p for p, _ in used}
             if isinstance(pid, int) and (pid, None) not in named]
            + [f"track {t} has no name" for t in used
               if isinstance(t[1], int) and t not in named])


def format_problems(trace: dict) -> list[str]:
    """What Perfetto needs of the JSON: the fields (the schema); then spans that nest and
    tracks that are named."""
    return schema_problems(trace) or nesting_problems(trace) + naming_problems(trace)


# ----- the schema holds torch's own exported trace -----


@pytest.fixture(scope="module")
def torchs_trace(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("torch") / "trace.json"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("outer"):
            with record_function("inner"):
                torch.randn(64, 64).mm(torch.randn(64, 64))
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())


def test_torchs_exported_trace_passes_the_schema(torchs_trace):
    assert {e["ph"] for e in torchs_trace["traceEvents"]} >= {"X", "M"}
    assert format_problems(torchs_trace) == []


def json_types(events: list[dict], phase: str) -> dict:
    """For the events of ``phase``: each key they all carry, with its JSON type."""
    kinds = {int: "number", float: "number", str: "string", dict: "object", list: "array"}
    of_phase = [e for e in events if e["ph"] == phase]
    keys = set.intersection(*(set(e) for e in of_phase))
    return {k: {kinds[type(e[k])] for e in of_phase} for k in keys}


def test_ours_carries_every_field_torchs_carries_with_its_type(torchs_trace):
    ours = trace_of(two_ranks_records())["traceEvents"]
    for phase in {"X", "i", "M"}:
        theirs = json_types(torchs_trace["traceEvents"], phase)
        mine = json_types(ours, phase)
        assert set(theirs) <= set(mine), (phase, set(theirs) - set(mine))
        assert all(mine[k] <= theirs[k] for k in theirs if k not in ("pid", "tid")), phase


# ----- two ranks' records, made up: one bucket's all_reduce overlapping the next's -----


def bucket(index: int, names: list[str], indices: list[int]) -> BucketInfo:
    return BucketInfo(index, names, indices, 4 * len(indices), 16 * len(indices),
                      torch.float32, torch.device("cpu"))


BUCKETS = [bucket(0, ["b.bias", "b.weight"], [3, 2]), bucket(1, ["a.bias", "a.weight"], [1, 0])]
STEP = [("ready", 3, 0.1), ("ready", 2, 0.2), ("launch", 0, 0.3), ("ready", 1, 0.5),
        ("ready", 0, 0.8), ("launch", 1, 0.9), ("backward_end", -1, 1.0), ("done", 0, 1.2),
        ("waited", 0, 1.25), ("done", 1, 1.5), ("waited", 1, 1.55), ("finalized", -1, 1.6)]


def two_ranks_records(late_s: float = 0.0002) -> list:
    """Rank 1 a little late; times in ms, on one clock."""
    return [(rank, [(e, i, 1e-3 * t + rank * late_s) for e, i, t in STEP], BUCKETS)
            for rank in range(2)]


def order_problems(trace: dict, rank: int, records: list) -> list[str]:
    """Each record of ``rank`` in the trace, in the records' order, each at its own time in
    microseconds (measured from the rank's first record)."""
    seen = []
    for e in trace["traceEvents"]:
        if e["pid"] != rank or e["ph"] == "M":
            continue
        name, args = e["name"], e["args"]
        if e["ph"] == "X" and name.startswith("all_reduce bucket "):
            seen += [("launch", args["bucket"], e["ts"]), ("done", args["bucket"],
                                                            e["ts"] + e["dur"])]
        elif name.startswith("ready "):
            seen.append(("ready", args["index"], e["ts"]))
        elif name.startswith("waited bucket "):
            seen.append(("waited", args["bucket"], e["ts"]))
        elif name in ("backward end", "finalized") and e["ph"] == "i":
            seen.append(("backward_end" if name == "backward end" else "finalized", -1, e["ts"]))
    seen.sort(key=lambda s: s[2])
    records = sorted(records, key=lambda r: r[2])
    if [s[:2] for s in seen] != [r[:2] for r in records]:
        return [f"rank {rank}: the trace's order {[s[:2] for s in seen]} is not the records' "
                f"{[r[:2] for r in records]}"]
    return [f"rank {rank}: {s[:2]} at {s[2] - seen[0][2]:.3f} us, recorded "
            f"{1e6 * (r[2] - records[0][2]):.3f} us after the first"
            for s, r in zip(seen, records)
            if abs((s[2] - seen[0][2]) - 1e6 * (r[2] - records[0][2])) > 2e-3]


def test_made_up_records_give_a_valid_trace_in_their_order():
    ranks = two_ranks_records()
    trace = trace_of(ranks)
    assert format_problems(trace) == []
    assert [p for rank, records, _ in ranks for p in order_problems(trace, rank, records)] == []
    lanes = {e["tid"] for e in trace["traceEvents"] if e["name"].startswith("all_reduce ")}
    assert lanes == {1, 2}, "two all_reduces partly at once need two tracks"
    starts = {e["pid"]: e["ts"] for e in trace["traceEvents"] if e["name"] == "ready b.bias"}
    assert starts == {0: 0.0, 1: 200.0}, "microseconds from the earliest event"


def test_a_launch_never_done_and_an_event_of_its_own_are_marks():
    """A wait that failed leaves a launch without its done; a caller's own record is a mark."""
    records = [*STEP[:6], ("backward_end", -1, 1.0), ("done", 0, 1.2), ("my_event", 7, 1.3)]
    trace = trace_of([(0, [(e, i, 1e-3 * t) for e, i, t in records], BUCKETS)])
    assert format_problems(trace) == []
    marks = [e["name"] for e in trace["traceEvents"] if e["ph"] == "i"]
    assert "launch bucket 1, never done" in marks and "my_event 7" in marks
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == [
        "gradients arriving", "all_reduce bucket 0"]


def test_a_timeline_never_set_says_how_to_record_one():
    with pytest.raises(ValueError, match=r"set ddp.reducer.timeline = \[\] before the step"):
        chrome_trace.chrome_trace(None)


# ----- a broken exporter fails the checks -----


def in_seconds(span):
    return lambda *a, **k: {**span(*a, **k), "dur": span(*a, **k)["dur"] / 1e6}


def one_track(spans):
    def broken(*a):
        found, _ = spans(*a)
        return [{**e, "tid": 1} for e in found], 1
    return broken


BREAKAGES = {
    "durations in seconds": ("_span", in_seconds),
    "overlapping all_reduces on one track": ("_all_reduce_spans", one_track),
    "marks without a scope": ("_mark", lambda mark: lambda *a, **k: {
        k2: v for k2, v in mark(*a, **k).items() if k2 != "s"}),
    "no track names": ("_meta", lambda meta: lambda *a, **k: {**meta(*a, **k), "args": {}}),
    "spans without dur": ("_span", lambda span: lambda *a, **k: {
        k2: v for k2, v in span(*a, **k).items() if k2 != "dur"}),
    "marks in seconds": ("_mark", lambda mark: lambda pid, name, ts, **k: mark(
        pid, name, ts / 1e6, **k)),
    "spans from their end to their start": ("_span", lambda span: lambda p, t, n, a, b, **k:
                                            span(p, t, n, b, a, **k)),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_exporter_fails_the_checks(monkeypatch, breakage):
    name, breaking = BREAKAGES[breakage]
    monkeypatch.setattr(chrome_trace, name, breaking(getattr(chrome_trace, name)))
    ranks = two_ranks_records()
    trace = trace_of(ranks)
    problems = format_problems(trace)
    if not problems:  # what the schema cannot see, the records' times can
        problems = [p for rank, records, _ in ranks for p in order_problems(trace, rank,
                                                                            records)]
    assert problems, f"{breakage}: the checks passed a broken trace"


# ----- a real step on 2 ranks -----


def traced_step(how: str, out_dir: str, clock_offset_s: float = 0.0) -> dict:
    """Two warm-up steps (the rebuild), then one recorded by ``how``; every rank's Chrome
    trace. ``clock_offset_s``: rank 1's clock reads that much later (another machine's)."""
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                      nn.Linear(32, 4)), bucket_cap_mb=0.0005)  # 3 buckets
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for _ in range(2):
        F.mse_loss(ddp(x), y).backward()
    loss = F.mse_loss(ddp(x), y)
    if how == "trace":
        with ddp.trace() as source:
            loss.backward()
        records = [(e, i, source.start + t) for e, i, t in source.events]
    else:
        ddp.reducer.timeline = source = []
        loss.backward()
        records = list(source)
    real = time.perf_counter
    if dist.get_rank() == 1 and clock_offset_s:
        records = [(e, i, t + clock_offset_s) for e, i, t in records]
        source = records
        chrome_trace.time.perf_counter = lambda: real() + clock_offset_s
    try:
        trace = save_chrome_trace(f"{out_dir}/{how}.json", source,
                                  ddp.buckets if how == "timeline" else ())
    finally:
        chrome_trace.time.perf_counter = real
    return {"trace": trace, "records": records, "buckets": len(ddp.buckets)}


@pytest.mark.parametrize("how", ["timeline", "trace"])
def test_a_real_step_on_two_ranks_is_one_valid_trace_in_the_order_of_its_events(ranks,
                                                                               tmp_path, how):
    results = ranks(2).run(traced_step, how, str(tmp_path))
    saved = json.loads((tmp_path / f"{how}.json").read_text())
    assert saved == json.loads(json.dumps(results[0]["trace"])) == json.loads(
        json.dumps(results[1]["trace"]))
    assert format_problems(saved) == []
    for rank, result in enumerate(results):
        assert result["buckets"] >= 3 and order_problems(saved, rank, result["records"]) == []
    assert {e["args"]["name"] for e in saved["traceEvents"]
            if e["name"] == "process_name"} == {"rank 0", "rank 1"}


def test_ranks_whose_clocks_differ_share_one_zero(ranks, tmp_path):
    """Rank 1's clock 1000 s ahead (as on another machine): its step still lines up with rank
    0's, within a fraction of a second (they ran at the same time)."""
    results = ranks(2).run(traced_step, "timeline", str(tmp_path), clock_offset_s=1000.0)
    first = {}
    for e in results[0]["trace"]["traceEvents"]:
        if e["ph"] == "i" and e["name"] == "finalized":
            first.setdefault(e["pid"], e["ts"])
    assert set(first) == {0, 1} and abs(first[0] - first[1]) < 0.5e6, first


@pytest.mark.slow
def test_the_readme_picture_is_drawn_from_a_valid_trace_of_a_real_step(tmp_path, monkeypatch):
    """``benchmarks/chrome_trace.py``: a 2-rank step's trace, valid, and its picture."""
    pytest.importorskip("matplotlib")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "chrome_trace.py"
    spec = importlib.util.spec_from_file_location("benchmark_chrome_trace", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # the ranks find its functions there
    spec.loader.exec_module(script)
    written = script.main(["--out", str(tmp_path)])
    trace = json.loads(written.read_text())
    assert format_problems(trace) == []
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert len([e for e in trace["traceEvents"] if e["name"].startswith("all_reduce b")]) >= 8
    assert (tmp_path / f"{script.TAG}.png").stat().st_size > 0
