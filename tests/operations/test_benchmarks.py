"""Every benchmark runs in ``--quick`` mode, checks its contestants and writes complete results.

Correctness only: no timing is ever asserted (times on a shared machine mean nothing alone).
The scripts run in this process (their ranks are forked from it) to skip seconds of
``import torch`` per script; one runs from the command line, as a user would.
"""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bucket_sweep  # noqa: E402
import gpu  # noqa: E402
import ladder  # noqa: E402
import memory  # noqa: E402
import no_sync  # noqa: E402
import overhead  # noqa: E402
import overlap  # noqa: E402
import zero_memory  # noqa: E402

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
        assert bucket_sweep.CONTROL not in r  # only with --control
        assert r["allreduce_calls"] == r["buckets"]
        assert len(r["miniddp"]["times_ms"]) == result["setup"]["pairs"]
        assert r["ratio_ci95"][0] <= r["ratio"] <= r["ratio_ci95"][1]
    if EXPLICIT_CAP_COVERS_FIRST_BUCKET:  # before 2.4 the first bucket stays 1 MiB whatever
        assert rows[-1]["buckets"] == result["model"]["tensors"]
    assert {"ratio", "ratio_ci95", "cpu_ratio"} <= set(result["all_caps"])


def test_bucket_sweep_also_runs_on_a_model_of_many_small_tensors_with_an_a_a_control(tmp_path):
    results = bucket_sweep.main(["--quick", "--device", "cpu", "--model", "small_tensors",
                                 "--control", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bucket_sweep-small_tensors-control-cpu-gloo-ws2.json")
                       .read_text())
    assert len(results) == 1 and saved["setup"]["model"] == "small_tensors"
    depth, width = bucket_sweep.harness.DEEP["small_tensors"]["quick"]
    assert saved["model"]["tensors"] == 2 * (depth + 1)
    assert saved["model"]["widths"] == [width] * (depth + 1) + [bucket_sweep.harness.OUT_FEATURES]
    assert all(r["bit_identical"] for r in saved["sweep"])
    if EXPLICIT_CAP_COVERS_FIRST_BUCKET:  # before 2.4 the first bucket stays 1 MiB whatever
        assert saved["sweep"][-1]["buckets"] == saved["model"]["tensors"]
    # The control: a second torch DDP at every cap, timed in the same rounds, ratio to torch's
    assert saved["setup"]["control"]
    for r in saved["sweep"]:
        control = r[bucket_sweep.CONTROL]
        assert TIMES <= set(control) and len(control["times_ms"]) == saved["setup"]["pairs"]
        assert control["ratio_ci95"][0] <= control["ratio"] <= control["ratio_ci95"][1]
        assert control["times_ms"] != r["torch"]["times_ms"]  # timed on its own
    assert {"control_ratio", "control_ratio_ci95"} <= set(saved["all_caps"])
    assert "torch again / torch (A/A)" in bucket_sweep.report(saved)
    pytest.importorskip("matplotlib")  # the figure shows both ratios, not the step times
    from matplotlib.figure import Figure
    ax = Figure().subplots()
    bucket_sweep.plot(saved, ax)
    assert "ratio" in ax.get_ylabel()
    assert {"miniddp / torch", "torch again / torch (A/A control)"} <= {
        t.get_text() for t in ax.get_legend().get_texts()}
    assert (tmp_path / "bucket_sweep-small_tensors-control-cpu-gloo-ws2.png").stat().st_size > 0


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
    assert "overlap_vs_after_backward" in result and result["nothing_to_overlap"] is None


@pytest.mark.parametrize("module", [overlap, ladder])
def test_at_world_size_one_there_is_nothing_to_overlap_and_no_number_says_otherwise(module,
                                                                                     tmp_path):
    """One rank has no communication to hide: no hidden fraction, no overlap ratio, a reason."""
    result = module.main(["--quick", "--device", "cpu", "--world-size", "1",
                          "--out", str(tmp_path)])[0]
    assert result["setup"]["world_size"] == 1
    assert "world size 1" in result["nothing_to_overlap"]
    assert "world size 1: there is no communication to hide" in module.report(result)
    if module is overlap:
        assert not any("hidden_fraction" in v for v in result["impls"].values())
        assert "overlap_saves_ms" not in result and "miniddp_hides_more_ms" not in result
    else:
        assert "overlap_vs_after_backward" not in result


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
    assert result["nothing_to_overlap"] is None
    assert len(result["bucket_mb"]) == result["buckets"]
    assert {"local", "after_backward", "communication"} <= set(result["times"])


def test_no_sync_times_every_accumulation_length(tmp_path):
    result = run(no_sync, tmp_path)
    assert result["bit_identical"]
    assert [r["sync_every"] for r in result["no_sync"]] == [1, 2, 4, 8]
    for r in result["no_sync"]:
        assert TIMES <= set(r["miniddp"]) and set(r["speedup_vs_every_step"]) == {"miniddp",
                                                                                  "torch"}


@pytest.mark.slow
def test_memory_measures_both_ddps_with_and_without_bucket_views(tmp_path):
    result = run(memory, tmp_path)
    assert result["bit_identical"]
    configs = {(r["impl"], r["gradient_as_bucket_view"], r["set_to_none"])
               for r in result["memory"]}
    assert configs == set(memory.CONFIGS) and len(configs) == 8
    assert all({"first_steps_peak_mb", "steady_peak_mb", "end_mb"} <= set(r)
               for r in result["memory"])
    assert all(len(r["peak_by_step_mb"]) == memory.STEPS for r in result["memory"])
    # every configuration in a rank group of its own: none can see another's tensors
    assert result["process_per_configuration"]
    assert len({r["pid"] for r in result["memory"]}) == len(memory.CONFIGS)


def test_memory_refuses_configurations_whose_parameters_differ():
    setup = memory.harness.Setup("memory", "cpu", "gloo", 2, "fork", True, 2, 3)
    figures = [{"row": {"impl": impl, "gradient_as_bucket_view": view, "set_to_none": none},
                "digest": f"{impl}{view}{none}" if (impl, view) == ("torch", True) else "same",
                "model": {}, "batch_per_rank": 8, "gpu": None, "gpus_visible": 0}
               for impl, view, none in memory.CONFIGS]
    with pytest.raises(RuntimeError, match="gradient_as_bucket_view=True.*parameters differ"):
        memory.combine(setup, figures)


def test_zero_memory_counts_each_ranks_optimizer_state_at_1_2_3_ranks(tmp_path):
    result = zero_memory.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "zero_memory-cpu-ws1-2-3.json").read_text())
    assert saved == json.loads(json.dumps(result)), "the JSON file differs from the result"
    assert MACHINE_FIELDS - {"seconds"} <= set(saved["machine"])
    rows = saved["per_world_size"]
    assert [r["world_size"] for r in rows] == [1, 2, 3]
    assert [len(r["state_mib_per_rank"]) for r in rows] == [1, 2, 3]
    for run, row in zip(saved["runs"], rows):
        assert run["bit_identical"] and row["same_as_torch"]
        assert row["total_over_whole"] == 1.0, "the shares add up to the whole state"
        if row["world_size"] > 1:  # sharded: every rank holds less than the whole
            assert max(run["state_bytes"]) < saved["runs"][0]["state_bytes"][0]
    assert sum(saved["runs"][2]["parameters_owned"]) == saved["model"]["parameters"]


def test_overhead_compares_one_bucket_and_one_bucket_per_parameter(tmp_path):
    result = run(overhead, tmp_path)
    rows = {r["buckets"]: r for r in result["overhead"]}
    assert set(rows) == {"one_bucket", "per_parameter"} and result["bit_identical"]
    assert rows["one_bucket"]["bucket_count"] == 1
    if EXPLICIT_CAP_COVERS_FIRST_BUCKET:  # before 2.4 the first bucket stays 1 MiB whatever
        assert rows["per_parameter"]["bucket_count"] == result["model"]["tensors"]
    assert all("extra_cpu_us_per_parameter" in r for r in rows.values())
    floor = result["python_floor"]
    assert {"empty_hook_cpu_us_per_parameter", "hook_and_copy_cpu_us_per_parameter",
            "bucket_per_parameter_cpu_us_per_parameter"} <= set(floor)
    for name in ("empty_hooks", "copy_hooks", "launch_hooks"):
        assert len(floor[name]["times_ms"]) == result["setup"]["pairs"]


@pytest.mark.parametrize("count", [2, 3, 16])
def test_rounds_run_every_call_never_one_twice_in_a_row_and_in_both_orders(count):
    from course.tools import round_orders
    names = [f"call{i}" for i in range(count)]
    orders = list(round_orders(names, 200))
    assert orders == list(round_orders(names, 200)), "every rank must get the same"
    assert all(sorted(order) == sorted(names) for order in orders)
    steps = [name for order in orders for name in order]
    assert all(a != b for a, b in zip(steps, steps[1:])), "a step ran twice in a row"
    if count == 2:
        return  # A B A B ...: the only order with no step twice in a row
    first = lambda a, b, order: order.index(a) < order.index(b)
    for a, b in zip(names, names[1:]):  # each neighbour of the list goes first about as often
        share = sum(first(a, b, order) for order in orders) / len(orders)
        assert 0.35 < share < 0.65, (a, b, share)


@pytest.mark.usefixtures("ranks_see_monkeypatches")
def test_a_wrong_miniddp_is_refused_before_any_number_is_reported(tmp_path, monkeypatch):
    """Negative control: gradients scaled by 0.49 instead of 0.5 must fail the bit check."""
    from miniddp.reducer import Reducer

    def scale_wrongly(self, source, out):
        torch.mul(source, 0.49, out=out)

    monkeypatch.setattr(Reducer, "_scale", scale_wrongly)  # inherited by the forks
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


# ----- where the ranks come from: the same plan on CPU and GPU, forked or under torchrun -----

@pytest.mark.parametrize("gpus, flags, expected", [
    (0, {}, [("gloo", 2, "fork")]),
    (1, {}, [("nccl", 1, "fork"), ("gloo", 2, "fork")]),
    (4, {}, [("nccl", 4, "fork")]),
    (1, {"world_size": 2}, [("gloo", 2, "fork")]),
    (2, {"world_size": 3}, [("gloo", 3, "fork")]),
    (0, {"torchrun": (3, 3)}, [("gloo", 3, "torchrun")]),
    (4, {"torchrun": (8, 4)}, [("nccl", 8, "torchrun")]),
    (2, {"torchrun": (4, 4)}, [("gloo", 4, "torchrun")]),
    (4, {"backend": "gloo"}, [("gloo", 4, "fork")]),
])
def test_one_rank_per_gpu_takes_nccl_else_gloo(gpus, flags, expected):
    plan = bucket_sweep.harness.plan(gpus, **flags)
    assert [(p["backend"], p["world_size"], p["launcher"]) for p in plan] == expected


# ----- --model: the user's own model, and ready-made ones -----

def linear_factory():
    """The least a factory can be: a model and a batch maker (the loss: mean squared error)."""
    def make_batch(generator):
        return torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), make_batch


def not_a_factory():
    return nn.Linear(2, 2)


@pytest.mark.parametrize("factory", ["examples.my_model:factory", "test_benchmarks:linear_factory"])
def test_a_users_model_through_its_factory(factory, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    result = bucket_sweep.main(["--quick", "--device", "cpu", "--model", factory,
                                "--out", str(tmp_path)])[0]
    assert result["model"]["name"] == factory and result["setup"]["model"] == factory
    assert all(r["bit_identical"] for r in result["sweep"])
    tag = bucket_sweep.harness.Setup(**result["setup"]).tag
    assert ":" not in tag and (tmp_path / f"{tag}.json").exists()
    if factory.startswith("examples"):
        assert result["model"]["class"] == "TinyTransformer" and result["model"]["tensors"] > 20


def test_a_factory_that_returns_something_else_is_refused_with_what_it_returned(tmp_path):
    with pytest.raises(RankError, match="must return \\(model, make_batch\\)"):
        bucket_sweep.main(["--quick", "--device", "cpu", "--model",
                           "test_benchmarks:not_a_factory", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="cannot import 'no_such_module'"):
        bucket_sweep.main(["--quick", "--device", "cpu", "--model", "no_such_module:f"])


@pytest.mark.parametrize("name, library", [("gpt2", "transformers"), ("resnet50", "torchvision")])
def test_ready_made_models_run_or_are_skipped_with_a_message(name, library, tmp_path, capsys):
    if importlib.util.find_spec(library) is None:
        assert no_sync.main(["--quick", "--device", "cpu", "--model", name]) == []
        assert f"skipped --model {name}: --model {name} needs {library}" in capsys.readouterr().out
        return
    # From the command line, as a user runs it: inside pytest (its faulthandler plugin), a rank
    # forked after importing transformers died silently (seen with transformers 5 on torch 2.13)
    done = subprocess.run([sys.executable, str(BENCHMARKS / "no_sync.py"), "--quick", "--device",
                           "cpu", "--model", name, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / f"no_sync-{name}-cpu-gloo-ws2.json").read_text())
    assert result["bit_identical"] and result["model"]["name"] == name


# ----- benchmarks/gpu.sh: its CPU dry run, the torchrun path, time limits -----

def gpu_sh(*flags, timeout=240):
    started = time.monotonic()
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), "--cpu", *flags],
                          capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


@pytest.mark.slow
def test_gpu_sh_dry_run_takes_the_several_gpu_path_under_torchrun_and_summarizes(tmp_path):
    """The CPU dry run of gpu.sh: the CUDA tests (skipped here) and a benchmark on the path of
    a machine with several GPUs (torchrun, one rank each), on 2 CPU ranks over gloo."""
    done, _ = gpu_sh("--ranks", "2", "--only", "tests,bucket_sweep", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "bucket_sweep-cpu-gloo-ws2.json").read_text())
    assert result["setup"]["launcher"] == "torchrun" and result["setup"]["world_size"] == 2
    assert all(r["bit_identical"] for r in result["sweep"])
    summary = (tmp_path / "gpu-summary.txt").read_text()
    assert "CPU dry run, torchrun with 2 ranks" in summary and summary in done.stdout
    assert "skipped" in summary.splitlines()[1]  # tests/engine/test_ddp_cuda.py, without a GPU
    assert "  gloo ws2 " in summary and "bucket_sweep, miniddp / torch step time" in summary
    assert (tmp_path / "logs" / "bucket_sweep.log").read_text().count("saved ") == 2


@pytest.mark.slow
def test_gpu_sh_stops_a_part_past_its_limit_names_it_and_goes_on(tmp_path):
    done, seconds = gpu_sh("--only", "overlap,ladder", "--limit", "overlap=1", "--limit",
                           "ladder=1", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 1 and seconds < 90
    summary = (tmp_path / "gpu-summary.txt").read_text()
    for part in ("overlap", "ladder"):
        assert f"HUNG or too slow: {part} did not finish in 1 s (its limit)" in summary


def test_gpu_sh_several_gpus_get_torchrun_except_memory_which_forks_its_own_groups(tmp_path):
    args = gpu.parse_args(["--out", str(tmp_path)])
    sweep = gpu.command("bucket_sweep", args, gpus=4, limit=100)
    assert "torch.distributed.run" in sweep and "--nproc_per_node=4" in sweep
    assert "--device" in sweep and sweep[sweep.index("--device") + 1] == "cuda"
    mem = gpu.command("memory", args, gpus=4, limit=100)
    assert "torch.distributed.run" not in mem and mem[mem.index("--world-size") + 1] == "4"
    assert "torch.distributed.run" not in gpu.command("bucket_sweep", args, gpus=1, limit=100)
    late = gpu.run_part("overlap", args, gpus=1, deadline=time.monotonic())
    assert late["status"] == "not run: the budget was spent"
