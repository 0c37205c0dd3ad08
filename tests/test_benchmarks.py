"""Every benchmark runs in ``--quick`` mode, checks its contestants and writes complete results.

Correctness only: no timing is ever asserted (times on a shared machine mean nothing alone).
The scripts run in this process (their ranks are forked from it) to skip seconds of
``import torch`` per script; one runs from the command line, as a user would.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bucket_sweep  # noqa: E402
import ladder  # noqa: E402
import memory  # noqa: E402
import no_sync  # noqa: E402
import overhead  # noqa: E402
import overlap  # noqa: E402

from miniddp.launch import RankError  # noqa: E402

SETUP_FIELDS = {"benchmark", "device", "backend", "world_size", "launcher", "quick", "warmup",
                "pairs"}
MACHINE_FIELDS = {"date", "host", "cpu", "cpu_cores", "python", "torch", "load_average_before",
                  "load_average_after", "seconds"}
TIMES = {"median_ms", "p25_ms", "p75_ms", "cpu_median_ms", "times_ms"}


def run(module, tmp_path) -> dict:
    results = module.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert len(results) == 1
    result = results[0]
    tag = module.harness.Setup(**result["setup"]).tag
    assert tag.startswith(result["benchmark"]) and tag.endswith("-cpu-gloo-ws2")
    saved = json.loads((tmp_path / f"{tag}.json").read_text())
    assert saved == json.loads(json.dumps(result)), "the JSON file differs from the result"
    assert SETUP_FIELDS <= set(saved["setup"]) and saved["setup"]["quick"]
    assert saved["setup"]["backend"] == "gloo" and saved["setup"]["world_size"] == 2
    assert MACHINE_FIELDS <= set(saved["machine"])
    assert saved["machine"]["torch"] == torch.__version__
    assert {"widths", "tensors", "parameters", "gradient_mb"} <= set(saved["model"])
    pytest.importorskip("matplotlib")
    assert (tmp_path / f"{tag}.png").stat().st_size > 0
    return saved


def test_bucket_sweep_checks_every_cap_against_torch(tmp_path):
    result = run(bucket_sweep, tmp_path)
    rows = result["sweep"]
    assert [r["bucket_cap_mb"] for r in rows] == ["1", "5", "10", "25", "50", "100", "250",
                                                  "per-parameter"]
    for r in rows:
        assert r["bit_identical"] and TIMES <= set(r["miniddp"]) and TIMES <= set(r["torch"])
        assert r["allreduce_calls"] == r["buckets"]
        assert len(r["miniddp"]["times_ms"]) == result["setup"]["pairs"]
        assert r["ratio_ci95"][0] <= r["ratio"] <= r["ratio_ci95"][1]
    if EXPLICIT_CAP_COVERS_FIRST_BUCKET:  # before 2.4 the first bucket stays 1 MiB whatever
        assert rows[-1]["buckets"] == result["model"]["tensors"]
    assert {"ratio", "ratio_ci95", "cpu_ratio"} <= set(result["all_caps"])


def test_bucket_sweep_also_runs_on_a_model_of_many_small_tensors(tmp_path):
    results = bucket_sweep.main(["--quick", "--device", "cpu", "--model", "small_tensors",
                                 "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bucket_sweep-small_tensors-cpu-gloo-ws2.json").read_text())
    assert len(results) == 1 and saved["setup"]["model"] == "small_tensors"
    depth, width = bucket_sweep.harness.DEEP["small_tensors"]["quick"]
    assert saved["model"]["tensors"] == 2 * (depth + 1)
    assert saved["model"]["widths"] == [width] * (depth + 1) + [bucket_sweep.harness.OUT_FEATURES]
    assert all(r["bit_identical"] for r in saved["sweep"])
    if EXPLICIT_CAP_COVERS_FIRST_BUCKET:  # before 2.4 the first bucket stays 1 MiB whatever
        assert saved["sweep"][-1]["buckets"] == saved["model"]["tensors"]


def test_ladder_has_every_rung_checked_and_its_call_count(tmp_path):
    result = run(ladder, tmp_path)
    rungs = {r["rung"]: r for r in result["ladder"]}
    assert list(rungs) == ladder.RUNGS
    for name in ("per_parameter", "buckets_after_backward", "overlap"):
        assert rungs[name]["bit_identical"], name
    assert rungs["DataParallel"]["relative_update_error"] < 1e-3
    assert rungs["DataParallel"]["allreduce_calls"] == 0
    assert rungs["DataParallel"]["weight_bytes_copied_per_step"] > 0
    assert rungs["per_parameter"]["allreduce_calls"] == result["model"]["tensors"]
    assert rungs["overlap"]["allreduce_calls"] == rungs["torch"]["allreduce_calls"] \
        == rungs["buckets_after_backward"]["allreduce_calls"]
    assert "overlap_vs_after_backward" in result


def test_overlap_reports_compute_communication_and_hidden(tmp_path):
    result = run(overlap, tmp_path)
    assert result["bit_identical"]
    for name in ("miniddp", "torch"):
        figures = result["impls"][name]
        assert {"compute_ms", "communication_ms", "step_ms", "ideal_ms", "serial_ms",
                "hidden_ms", "hidden_fraction"} <= set(figures)
        low, high = figures["hidden_fraction_ci95"]
        assert low <= figures["hidden_fraction"] <= high
        assert figures["ideal_ms"] <= figures["serial_ms"]
    assert {"miniddp_hides_more_ms", "overlap_saves_ms", "compute_ratio"} <= set(result)
    assert len(result["bucket_mb"]) == result["buckets"]
    assert {"local", "after_backward", "communication"} <= set(result["times"])


def test_no_sync_times_every_accumulation_length(tmp_path):
    result = run(no_sync, tmp_path)
    assert result["bit_identical"]
    assert [r["sync_every"] for r in result["no_sync"]] == [1, 2, 4, 8]
    for r in result["no_sync"]:
        assert TIMES <= set(r["miniddp"]) and set(r["speedup_vs_every_step"]) == {"miniddp",
                                                                                  "torch"}


def test_memory_measures_both_ddps_with_and_without_bucket_views(tmp_path):
    result = run(memory, tmp_path)
    assert result["bit_identical"]
    configs = {(r["impl"], r["gradient_as_bucket_view"], r["set_to_none"])
               for r in result["memory"]}
    assert configs == set(memory.CONFIGS) and len(configs) == 8
    assert all({"first_steps_peak_mb", "steady_peak_mb", "end_mb"} <= set(r)
               for r in result["memory"])


def test_overhead_compares_one_bucket_and_one_bucket_per_parameter(tmp_path):
    result = run(overhead, tmp_path)
    rows = {r["buckets"]: r for r in result["overhead"]}
    assert set(rows) == {"one_bucket", "per_parameter"} and result["bit_identical"]
    assert rows["one_bucket"]["bucket_count"] == 1
    if EXPLICIT_CAP_COVERS_FIRST_BUCKET:  # before 2.4 the first bucket stays 1 MiB whatever
        assert rows["per_parameter"]["bucket_count"] == result["model"]["tensors"]
    assert all("extra_cpu_us_per_parameter" in r for r in rows.values())
    floor = result["python_floor"]
    assert {"empty_hook_cpu_us_per_parameter", "hook_and_copy_cpu_us_per_parameter"} <= set(floor)
    for name in ("empty_hooks", "copy_hooks"):
        assert len(floor[name]["times_ms"]) == result["setup"]["pairs"]


@pytest.mark.usefixtures("ranks_see_monkeypatches")
def test_a_wrong_miniddp_is_refused_before_any_number_is_reported(tmp_path, monkeypatch):
    """Negative control: gradients scaled by 0.49 instead of 0.5 must fail the bit check."""
    from miniddp.reducer import Reducer

    def scale_wrongly(self, param, view):
        torch.mul(param.grad, 0.49, out=view)

    monkeypatch.setattr(Reducer, "_copy_into_bucket", scale_wrongly)  # inherited by the forks
    with pytest.raises(RankError, match="correctness check failed"):
        no_sync.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("*.json"))


def test_command_line_quick_run(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "overlap.py"), "--quick",
                           "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "hidden fraction" in done.stdout
    assert json.loads((tmp_path / "overlap-cpu-gloo-ws2.json").read_text())["bit_identical"]
