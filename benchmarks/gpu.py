"""One command for whoever has a GPU: the CUDA tests and every benchmark, and a one-screen summary.

    bash benchmarks/gpu.sh                                 # a GPU machine: ~6 min on one H100
    bash benchmarks/gpu.sh --model examples.my_model:factory   # your model (see that file)
    bash benchmarks/gpu.sh --cpu                           # the same steps, tiny, on the CPU
    bash benchmarks/gpu.sh --cpu --ranks 3                 # ... the several-GPU path, on CPUs

Runs ``tests/engine/test_ddp_cuda.py``, then every benchmark, each as a process of its own under a
time limit that names it when it is exceeded (it is stopped with everything it started, and the
rest still runs), all within ``--budget`` seconds (9.5 minutes). Results go to
``benchmarks/results`` (JSON, PNG), every part's output to ``<out>/logs/<part>.log``, and the
summary (tests passed, miniddp / torch per bucket cap, memory, overlap, per-parameter overhead)
to ``<out>/gpu-summary.txt`` and the screen.

Where the ranks come from is the harness's choice (``harness.plan``), the same on CPU and GPU:
with one GPU, NCCL at world size 1 and then 2 ranks sharing the GPU over gloo; with several,
NCCL with one rank per GPU, started by torchrun (``--standalone --nproc_per_node=<GPUs>``).
``--ranks N`` asks for that torchrun path with N ranks anywhere: with ``--cpu`` it runs it on
gloo, which is how the suite tests the path no machine here can run
(tests/operations/test_benchmarks.py).
memory.py forks its own rank group per configuration (``--world-size N``) instead: under
torchrun its configurations would share the ranks' processes, the fault it exists to avoid
(zero_memory.py, where present, forks its own groups too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

# Count GPUs through NVML: this process starts the others and never needs CUDA itself.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)] if str(ROOT) not in sys.path else []

from miniddp.launch.torchrun_agents import run_agents, torchrun  # noqa: E402

#: part: its time limit in seconds on a GPU machine (--cpu runs are tiny and get the same).
#: A benchmark whose script is not in this checkout is left out.
PARTS = {"tests": 180, "bucket_sweep": 240, "ladder": 100, "overlap": 100, "no_sync": 100,
         "memory": 150, "overhead": 150, "zero_memory": 100, "fsdp": 100}
PARTS = {part: limit for part, limit in PARTS.items()
         if part == "tests" or (HERE / f"{part}.py").exists()}
#: benchmarks that start their own rank groups (each configuration or world size in fresh
#: processes), never run under torchrun: the flags that give them the ranks asked for
OWN_RANK_GROUPS = {"memory": lambda ranks: ["--world-size", str(ranks)],
                   "zero_memory": lambda ranks: []}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true",
                   help="dry run: every step on the CPU, with --quick models (about a minute)")
    p.add_argument("--ranks", type=int, help="torchrun with this many ranks on this machine "
                   "(default: one per GPU where there are several; else the harness's setups)")
    p.add_argument("--model", action="append", default=[],
                   help="a benchmark model, repeatable (see benchmarks/models.py)")
    p.add_argument("--only", help=f"comma-separated parts (default all: {', '.join(PARTS)})")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results; "
                   "benchmarks/results/quick with --cpu)")
    p.add_argument("--budget", type=float, default=570.0, help="seconds for everything")
    p.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS",
                   help="another time limit for one part, e.g. --limit bucket_sweep=400")
    args = p.parse_args(argv)
    args.parts = args.only.split(",") if args.only else list(PARTS)
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        p.error(f"--only: unknown part(s) {unknown}; the parts are {', '.join(PARTS)}")
    args.limits = dict(PARTS)
    for item in args.limit:
        part, _, seconds = item.partition("=")
        if part not in PARTS or not re.fullmatch(r"[0-9.]+", seconds):
            p.error(f"--limit {item}: expected PART=SECONDS with PART one of {', '.join(PARTS)}")
        args.limits[part] = float(seconds)
    args.out = args.out or HERE / "results" / ("quick" if args.cpu else "")
    return args


def gpu_count() -> int:
    import torch  # here only: importing it costs seconds, and the CPU dry run needs it too

    return torch.cuda.device_count()


def command(part: str, args, gpus: int, limit: float) -> list[str]:
    """The command line of one part."""
    if part == "tests":
        # -n 0: one file, so pytest-xdist (the project's addopts) would hand it all to one
        # worker and start the others only for them to import torch and wait.
        return [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                str(ROOT / "tests" / "engine" / "test_ddp_cuda.py")]
    flags = ["--device", "cpu", "--quick"] if args.cpu else ["--device", "cuda"]
    flags += ["--out", str(args.out), "--timeout", f"{limit:g}"]
    for model in args.model:
        flags += ["--model", model]
    ranks = args.ranks or (gpus if gpus > 1 and not args.cpu else None)
    script = str(HERE / f"{part}.py")
    if ranks and part in OWN_RANK_GROUPS:
        return [sys.executable, script, *flags, *OWN_RANK_GROUPS[part](ranks)]
    if ranks:
        return torchrun("--standalone", f"--nproc_per_node={ranks}", script, *flags)
    return [sys.executable, script, *flags]


def run_part(part: str, args, gpus: int, deadline: float) -> dict:
    """Run one part under its limit (or what is left of the budget); say how it ended."""
    left = deadline - time.monotonic()
    limit = min(args.limits[part], left)
    if left < 1:
        return {"part": part, "status": "not run: the budget was spent", "seconds": 0.0}
    cmd = command(part, args, gpus, limit)
    print(f"\n=== {part} (limit {limit:.0f} s): {' '.join(cmd)}", flush=True)
    if part == "memory" and not args.cpu:  # where each live block came from (memory.py)
        os.environ["MINIDDP_MEMORY_SNAPSHOTS"] = str(args.out / "logs" / "memory-snapshots")
    started = time.monotonic()
    done = run_agents([cmd], [f"[{part}] "], timeout=limit, grace=0.0)
    seconds = round(time.monotonic() - started, 1)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    (args.out / "logs" / f"{part}.log").write_text(done.outputs[0])
    if done.stopped.startswith("still running"):
        cut = "the budget" if limit < args.limits[part] else "its limit"
        status = (f"HUNG or too slow: {part} did not finish in {limit:.0f} s ({cut}); it was "
                  f"stopped, see logs/{part}.log for where it was")
    elif done.codes[0] != 0:
        status = f"FAILED: {part} exited with status {done.codes[0]}, see logs/{part}.log"
    else:
        status = "ok"
    return {"part": part, "status": status, "seconds": seconds, "output": done.outputs[0]}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    gpus = 0 if args.cpu else gpu_count()
    if not args.cpu and gpus == 0:
        sys.exit("no GPU is visible (nvidia-smi, CUDA_VISIBLE_DEVICES?); "
                 "for a dry run of every step on the CPU: bash benchmarks/gpu.sh --cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = time.monotonic() + args.budget
    runs = [run_part(part, args, gpus, deadline) for part in args.parts]
    text = summary(runs, args, gpus, start)
    (args.out / "gpu-summary.txt").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0 if all(r["status"] == "ok" for r in runs) else 1


# ----- the summary: one screen -----

def results_of(out: Path, benchmark: str, since: float) -> list[dict]:
    """This run's JSON results of ``benchmark``, in the order they were written."""
    paths = [p for p in out.glob(f"{benchmark}-*.json") if p.stat().st_mtime >= since - 1]
    return [json.loads(p.read_text()) for p in sorted(paths, key=lambda p: p.stat().st_mtime)]


def where(result: dict) -> str:
    s = result["setup"]
    model = "" if s.get("model", "wide") == "wide" else f" {s['model']}"
    return f"{s['backend']} ws{s['world_size']}{model}"


def tests_line(run: dict) -> str:
    last = [line for line in run.get("output", "").splitlines()
            if re.search(r"\b(passed|failed|skipped|error)", line)]
    return f"tests/engine/test_ddp_cuda.py: {last[-1].strip('= ') if last else run['status']}"


def summary(runs: list[dict], args, gpus: int, since: float) -> str:
    by_part = {r["part"]: r for r in runs}
    lines = [f"miniddp GPU run, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(since))}: "
             f"{'CPU dry run' if args.cpu else f'{gpus} GPU(s)'}"
             f"{f', torchrun with {args.ranks} ranks' if args.ranks else ''}; "
             f"{sum(r['seconds'] for r in runs):.0f} s in all; results in {args.out}"]
    if "tests" in by_part:
        lines.append(tests_line(by_part["tests"]))
    for result in results_of(args.out, "bucket_sweep", since):
        rows = result["sweep"]
        if not lines[-1].startswith("bucket_sweep"):
            caps = " ".join(f"{r['bucket_cap_mb'].replace('per-parameter', 'per-p'):>6}"
                            for r in rows)
            lines.append(f"bucket_sweep, miniddp / torch step time:  {caps} pooled")
        ratios = " ".join(f"{r['ratio']:6.3f}" for r in rows)
        lines.append(f"  {where(result):<37}{ratios} {result['all_caps']['ratio']:6.3f}")
    for result in results_of(args.out, "overhead", since):
        one, per = result["overhead"]
        lines.append(f"overhead {where(result)}: extra CPU per parameter over torch "
                     f"{one['extra_cpu_us_per_parameter']:.1f} us (one bucket), "
                     f"{per['extra_cpu_us_per_parameter']:.1f} us (one each); empty hook "
                     f"{result['python_floor']['empty_hook_cpu_us_per_parameter']:.1f} us")
    for result in results_of(args.out, "memory", since):
        rows = {(r["impl"], r["gradient_as_bucket_view"], r["set_to_none"]): r
                for r in result["memory"]}
        cells = [f"view={'T' if v else 'F'},none={'T' if n else 'F'} "
                 f"{rows['miniddp', v, n]['steady_peak_mb']:.0f}/"
                 f"{rows['torch', v, n]['steady_peak_mb']:.0f}"
                 for v in (False, True) for n in (True, False)]
        lines.append(f"memory {where(result)}, steady peak MB miniddp/torch "
                     f"({result['model']['gradient_mb']} MB of gradients): " + "; ".join(cells))
    for result in results_of(args.out, "overlap", since):
        if result.get("nothing_to_overlap"):
            lines.append(f"overlap {where(result)}: nothing to overlap (world size 1)")
            continue
        hidden = {n: v["hidden_fraction"] for n, v in result["impls"].items()}
        lines.append(f"overlap {where(result)}: hidden fraction miniddp "
                     f"{hidden['miniddp']:.2f}, torch {hidden['torch']:.2f}; overlap saves "
                     f"{result['overlap_saves_ms']:.1f} ms against buckets after backward")
    for result in results_of(args.out, "ladder", since):
        rungs = ", ".join(f"{r['rung']} {r.get('ratio', 1.0):.2f}" for r in result["ladder"])
        lines.append(f"ladder {where(result)}, step / torch's: {rungs}")
    for result in results_of(args.out, "no_sync", since):
        ratios = ", ".join(f"{r['sync_every']}: {r['ratio']:.3f}" for r in result["no_sync"])
        lines.append(f"no_sync {where(result)}, miniddp / torch by sync interval: {ratios}")
    for run in runs:
        lines.append(f"  {run['part']:<13}{run['seconds']:6.0f} s  {run['status']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
