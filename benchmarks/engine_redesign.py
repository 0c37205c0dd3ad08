"""Before and after the engine redesign (issue 33): miniddp's step time, one engine against the
other, side by side in the same ranks.

Two engines cannot both be the package ``miniddp`` in one process, so the one before is copied
to a temporary directory as the package ``miniddp_before`` (every ``miniddp`` in its sources
renamed). Each rank then wraps copies of one model in three DDPs per cap: the engine after, the
engine before, and the engine before again (the A/A control), and times one step of each in
turn, round after round (a new order every round, as benchmarks/harness.py does). A round's
ratios are ``after / before`` and ``before again / before``; the report is their median and
spread over the rounds. A cap is slower only where its ratio is further from 1 than the
control's spread. Before any time is kept, the three DDPs must hold the same buckets and, after
the warm-up steps, bit-identical parameters. Models: ``wide`` and ``small_tensors``
(benchmarks/harness.py); caps 1 MB, 25 MB and one bucket per parameter.

    git worktree add --detach ../engine-before 6258cad
    python benchmarks/engine_redesign.py --before ../engine-before --rounds 30
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAPS = {"1": 1.0, "25": 25.0, "per-parameter": None}  # None: harness.PER_PARAMETER_MB
MODELS = ("wide", "small_tensors")
NAMES = ("after", "before", "before again")


def renamed_copy(checkout: Path, into: Path) -> None:
    """``checkout``'s ``miniddp`` as the package ``miniddp_before`` under ``into``."""
    target = into / "miniddp_before"
    shutil.copytree(checkout / "miniddp", target)
    for path in target.rglob("*.py"):
        path.write_text(re.sub(r"\bminiddp\b", "miniddp_before", path.read_text()))


def _rank(rank: int, world: int, store: str, out: str, packages: str, rounds: int,
          warmup: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path[:0] = [packages, str(HERE)]
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    import harness
    import miniddp_before

    import miniddp

    wrappers = {"after": miniddp.DistributedDataParallel,
                "before": miniddp_before.DistributedDataParallel,
                "before again": miniddp_before.DistributedDataParallel}
    device = torch.device("cpu")
    steps, ddps = {}, {}
    for model in MODELS:
        setup = harness.Setup("engine_redesign", "cpu", "gloo", world, "fork", False, warmup,
                              rounds, model=model)
        base = harness.make_model(setup, device)
        batches = harness.make_batches(setup, device, rank)
        for label, cap in CAPS.items():
            cap = harness.PER_PARAMETER_MB if cap is None else cap
            for name, wrap in wrappers.items():
                ddps[model, label, name] = wrap(copy.deepcopy(base), bucket_cap_mb=cap)
                steps[model, label, name] = harness.Trainer(ddps[model, label, name],
                                                            batches).step
    for _ in range(warmup):
        for step in steps.values():
            step()
    for model, label, name in ddps:
        ours, theirs = ddps[model, label, name], ddps[model, label, "before"]
        harness.check([b.param_indices for b in ours.buckets]
                      == [b.param_indices for b in theirs.buckets]
                      and harness.identical_models(ours, theirs, device),
                      f"{name} and before differ at {model}, cap {label}")
    times = {key: [] for key in steps}
    for order in harness.round_orders(list(steps), rounds):
        for key in order:
            dist.barrier()
            start = time.perf_counter()
            steps[key]()
            times[key].append(harness.slowest_rank([time.perf_counter() - start],
                                                     device)[0])
    if rank == 0:
        Path(out).write_text(json.dumps([[*key, values] for key, values in times.items()]))
    dist.destroy_process_group()


def measure(before: Path, rounds: int, warmup: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        renamed_copy(before, Path(tmp))
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "store"), out, tmp, rounds,
                                        warmup), nprocs=2, start_method="fork")
        times = json.loads(Path(out).read_text())
    return {(model, label, name): values for model, label, name, values in times}


def report(times: dict) -> dict:
    rows = {}
    for model in MODELS:
        for label in CAPS:
            before = times[model, label, "before"]
            row = {"before_ms": 1000 * statistics.median(before)}
            for name in ("after", "before again"):
                ratios = sorted(a / b for a, b in zip(times[model, label, name], before))
                q = statistics.quantiles(ratios, n=4)
                row[name] = {"median": statistics.median(ratios), "q1": q[0], "q3": q[2]}
            rows[f"{model} {label}"] = row
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the old engine")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=HERE / "results" / "engine-redesign-cpu-gloo-ws2.json")
    args = parser.parse_args(argv)
    times = measure(args.before.resolve(), args.rounds, args.warmup)
    rows = report(times)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "ratios": rows, "rounds": args.rounds, "warmup": args.warmup,
        "before": _commit_of(args.before), "times_s": {" ".join(k): v for k, v in times.items()}},
        indent=1))
    print(f"{'model cap':28} {'after/before [q1, q3]':>24} {'A/A control [q1, q3]':>24}"
          "  before (ms)")
    for key, row in rows.items():
        cells = [f"{row[n]['median']:.3f} [{row[n]['q1']:.3f}, {row[n]['q3']:.3f}]"
                 for n in ("after", "before again")]
        print(f"{key:28} {cells[0]:>24} {cells[1]:>24}  {row['before_ms']:.1f}")


def _commit_of(tree) -> str:
    """The commit checked out at ``tree`` (what the results were measured against), not the
    path, which is only this machine's."""
    import subprocess

    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
