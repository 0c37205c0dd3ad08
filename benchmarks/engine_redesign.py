"""Before and after the engine redesign (issue 33): miniddp's step time, one engine against the
other, side by side on the same machine.

Two engines cannot share one process (both are the package ``miniddp``), so each timing is a
*segment*: a fresh pair of gloo ranks (fork) importing one engine from its checkout, timing every
(model, cap) in turn, one step each per round after warm-up steps. A run is several rounds of
segments ``before``, ``after`` and ``before again`` (the A/A control) in a rotating order; each
round gives the ratio ``after / before`` and ``before again / before`` per (model, cap), and the
report is the median of those ratios with their spread. A cap is slower only where its ratio
is further from 1 than the control's spread. Models: ``wide`` and ``small_tensors``
(benchmarks/harness.py); caps 1 MB, 25 MB and one bucket per parameter.

    git -C /work/main worktree add --detach /work/wt/engine-before 6258cad
    python benchmarks/engine_redesign.py --before /work/wt/engine-before --after . --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAPS = {"1": 1.0, "25": 25.0, "per-parameter": None}  # None: harness.PER_PARAMETER_MB
MODELS = ("wide", "small_tensors")


def segment(warmup: int, steps: int) -> dict:
    """In a fresh process: time every (model, cap) with the engine on ``sys.path``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "store"), out, warmup, steps),
                           nprocs=2, start_method="fork")
        return json.loads(Path(out).read_text())


def _rank(rank: int, world: int, store: str, out: str, warmup: int, steps: int) -> None:
    import copy

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    sys.path.insert(0, str(HERE))
    import harness

    import miniddp

    trainers = {}
    for model in MODELS:
        setup = harness.Setup("engine_redesign", "cpu", "gloo", world, "fork", False, warmup,
                              steps, model=model)
        device = torch.device("cpu")
        base = harness.make_model(setup, device)
        batches = harness.make_batches(setup, device, rank)
        for label, cap in CAPS.items():
            cap = harness.PER_PARAMETER_MB if cap is None else cap
            ddp = miniddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
            trainers[f"{model} {label}"] = harness.Trainer(ddp, batches)
    times = {name: [] for name in trainers}
    for step in range(warmup + steps):
        for name, trainer in trainers.items():
            dist.barrier()
            start = time.perf_counter()
            trainer.step()
            elapsed = harness.max_over_ranks([time.perf_counter() - start], device)[0]
            if step >= warmup:
                times[name].append(elapsed)
    if rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in times.items()}))
    dist.destroy_process_group()


def run_segment(engine: Path, warmup: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(engine)}
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import engine_redesign as e;"
            f" print(json.dumps(e.segment({warmup}, {steps})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"a segment with the engine at {engine} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the old engine")
    parser.add_argument("--after", type=Path, default=HERE.parent)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path,
                        default=HERE / "results" / "engine-redesign-cpu-gloo-ws2.json")
    args = parser.parse_args(argv)
    engines = {"before": args.before.resolve(), "after": args.after.resolve(),
               "before again": args.before.resolve()}
    order = list(engines)
    rounds = []
    for r in range(args.rounds):
        this = {}
        for name in order[r % 3:] + order[:r % 3]:  # rotate who goes first
            this[name] = run_segment(engines[name], args.warmup, args.steps)
        rounds.append(this)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    report = {}
    for key in rounds[0]["before"]:
        ratios = {name: sorted(rd[name][key] / rd["before"][key] for rd in rounds)
                  for name in ("after", "before again")}
        report[key] = {name: {"median": statistics.median(v), "min": v[0], "max": v[-1]}
                       for name, v in ratios.items()}
        report[key]["before_s"] = statistics.median(rd["before"][key] for rd in rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": rounds, "ratios": report,
                                    "engines": {k: str(v) for k, v in engines.items()},
                                    "warmup": args.warmup, "steps": args.steps}, indent=1))
    print(f"{'model cap':28} {'after/before':>24} {'A/A control':>24}  before (s)")
    for key, row in report.items():
        cells = [f"{row[n]['median']:.3f} [{row[n]['min']:.3f}, {row[n]['max']:.3f}]"
                 for n in ("after", "before again")]
        print(f"{key:28} {cells[0]:>24} {cells[1]:>24}  {row['before_s']:.4f}")


if __name__ == "__main__":
    main()
