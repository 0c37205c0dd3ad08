"""Gradient accumulation with ``no_sync``: time per micro-batch when syncing every 1, 2, 4, 8.

A step of ``k`` micro-batches runs the first ``k - 1`` forwards inside ``no_sync`` (gradients
accumulate locally) and synchronizes on the last, then takes one optimizer step: one round of
all_reduces per ``k`` micro-batches. A miniddp and a torch DDP for every ``k`` are timed in
turn, and each pair must end with bit-identical parameters.

    python benchmarks/no_sync.py           # no GPU: gloo, 2 CPU ranks, 1-2 minutes
    python benchmarks/no_sync.py --quick   # smoke run, seconds
"""

from __future__ import annotations

import copy
import functools

import harness
import torch.distributed as dist
from harness import Trainer, check, summarize
from torch import nn

import miniddp
from course.report import print0

SYNC_EVERY = [1, 2, 4, 8]


def measure(setup: harness.Setup) -> dict:
    device = harness.rank_device(setup)
    base = harness.make_model(setup, device)
    batches = harness.make_batches(setup, device, dist.get_rank())
    kwargs = harness.ddp_kwargs(device)
    # A pair of DDPs per accumulation length: each pair takes the same steps whatever order
    # the rounds run the contestants in.
    ddps = {(k, "miniddp"): miniddp.DistributedDataParallel(copy.deepcopy(base), **kwargs)
            for k in SYNC_EVERY}
    ddps.update({(k, "torch"): nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kwargs)
                 for k in SYNC_EVERY})
    calls = {key: functools.partial(Trainer(ddp, batches).step, micro=key[0])
             for key, ddp in ddps.items()}
    print0(f"  sync every {SYNC_EVERY} micro-batches x (miniddp, torch), "
           f"{setup.pairs} timed rounds")
    times = harness.alternate(calls, setup.pairs, device, setup.warmup, "no_sync")
    for k in SYNC_EVERY:
        check(harness.identical_models(ddps[k, "miniddp"].module, ddps[k, "torch"].module, device),
              f"syncing every {k}: parameters differ from torch's after the timed steps")
    trainers = ("miniddp", "torch")
    per_micro = {key: {"wall": [x / key[0] for x in t["wall"]],
                       "cpu": [x / key[0] for x in t["cpu"]]} for key, t in times.items()}
    rows = []
    for k in SYNC_EVERY:
        s = summarize({name: per_micro[k, name] for name in trainers}, "torch")
        rows.append({"sync_every": k, "ratio": s["miniddp"]["ratio"],
                     "ratio_ci95": s["miniddp"]["ratio_ci95"], **s,
                     "speedup_vs_every_step": {
                         name: harness.median_ratio(per_micro[1, name]["wall"],
                                                    per_micro[k, name]["wall"])[0]
                         for name in trainers}})
    return {"model": harness.model_info(base, setup),
            "batch_per_rank": harness.batch_size(batches),
            **harness.rank_facts(device), "bit_identical": True, "no_sync": rows}


def plot(result: dict, ax) -> None:
    rows = result["no_sync"]
    ks = [r["sync_every"] for r in rows]
    for name in ("miniddp", "torch"):
        med = [r[name]["median_ms"] for r in rows]
        err = [[m - r[name]["p25_ms"] for m, r in zip(med, rows)],
               [r[name]["p75_ms"] - m for m, r in zip(med, rows)]]
        ax.errorbar(ks, med, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    s = result["setup"]
    ax.set(xlabel="synchronize every k micro-batches", ylabel="time per micro-batch (ms)",
           title=f"no_sync: {s['backend']}, {s['world_size']} ranks, {s['device']}")
    ax.set_ylim(bottom=0)
    ax.legend()


def report(result: dict) -> str:
    rows = [[r["sync_every"], r["miniddp"]["median_ms"], r["torch"]["median_ms"], r["ratio"],
             r["speedup_vs_every_step"]["miniddp"], r["speedup_vs_every_step"]["torch"]]
            for r in result["no_sync"]]
    return harness.table(["sync every", "miniddp ms/micro-batch", "torch ms/micro-batch",
                          "miniddp / torch", "miniddp speed-up vs 1", "torch speed-up vs 1"],
                         rows)


def main(argv=None) -> list[dict]:
    return harness.main("no_sync", __doc__, measure, plot, report, argv, pairs=16)


if __name__ == "__main__":
    main()
