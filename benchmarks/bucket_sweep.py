"""Bucket-size sweep: miniddp's and torch's DDP step time at each ``bucket_cap_mb``.

For every cap in 1, 5, 10, 25, 50, 100, 250 MiB and one bucket per parameter, both DDPs wrap
copies of the same model and train on the same batches, one step each in turn. Before any time
is reported they must hold the same buckets and bit-identical parameters. Two models, one after
the other: ``wide`` (46 tensors, 49 MB of gradients: bandwidth) and ``small_tensors`` (122
tensors of 0.5 to 64 KiB, as a transformer's biases and norms: the per-tensor machinery).

    python benchmarks/bucket_sweep.py                        # no GPU: gloo, 2 CPU ranks, 4-8 min
    python benchmarks/bucket_sweep.py --model small_tensors  # one model
    python benchmarks/bucket_sweep.py --quick                # smoke run, seconds
    python benchmarks/bucket_sweep.py --model small_tensors --control --pairs 200

``--control`` times a second torch DDP at every cap in the same rounds (an A/A control): its
ratio to the first torch DDP would be 1 on a quiet machine, and how far it is from 1 is how far
miniddp's ratio at that cap can be off for reasons that are not miniddp's.

With GPUs, see benchmarks/README.md (NCCL; torchrun for several GPUs).
"""

from __future__ import annotations

import copy

import harness
import torch.distributed as dist
from harness import PER_PARAMETER_MB, Trainer, check, summarize
from torch import nn

import miniddp
from course.report import print0

CAPS = [1, 5, 10, 25, 50, 100, 250, PER_PARAMETER_MB]
CONTROL = "torch again"  # --control: a second torch DDP, timed as the others are


def cap_label(cap: float) -> str:
    return "per-parameter" if cap == PER_PARAMETER_MB else f"{cap:g}"


def measure(setup: harness.Setup) -> dict:
    """Every cap's pair of DDPs lives at once, so each round times all of them in turn: load
    that comes and goes on the machine hits every cap alike."""
    device = harness.rank_device(setup)
    base = harness.make_model(setup, device)
    batches = harness.make_batches(setup, device, dist.get_rank())
    kwargs = harness.ddp_kwargs(device)
    compared = ["miniddp", CONTROL] if setup.control else ["miniddp"]  # each against torch
    names = compared + ["torch"]
    ddps, calls = {}, {}
    for cap in CAPS:
        for name in names:
            wrap = miniddp.DistributedDataParallel if name == "miniddp" \
                else nn.parallel.DistributedDataParallel
            ddps[cap, name] = wrap(copy.deepcopy(base), bucket_cap_mb=cap, **kwargs)
            calls[cap, name] = Trainer(ddps[cap, name], batches).step
    print0(f"  {len(CAPS)} caps x ({', '.join(names)}), {setup.pairs} timed rounds")
    times = harness.alternate(calls, setup.pairs, device, setup.warmup, "bucket sweep")
    rows = []
    for cap in CAPS:
        label = f"bucket_cap_mb={cap_label(cap)}"
        ours, theirs = ddps[cap, "miniddp"], ddps[cap, "torch"]
        check(harness.ours_layout(ours) == harness.torch_layout(theirs),
              f"{label}: miniddp's buckets differ from torch's")
        for name in compared:
            check(harness.identical_models(ddps[cap, name].module, theirs.module, device),
                  f"{label}: {name}'s parameters differ from torch's after the timed steps")
        s = summarize({name: times[cap, name] for name in names}, "torch")
        rows.append({"bucket_cap_mb": cap_label(cap), "buckets": len(ours.buckets),
                     "allreduce_calls": ours.allreduce_calls, "bit_identical": True,
                     "ratio": s["miniddp"]["ratio"], "ratio_ci95": s["miniddp"]["ratio_ci95"],
                     **s})
        control = f", control {s[CONTROL]['ratio']:.3f}" if setup.control else ""
        print0(f"  {label}: {len(ours.buckets)} buckets, miniddp "
               f"{s['miniddp']['median_ms']:.1f} ms, torch {s['torch']['median_ms']:.1f} ms, "
               f"ratio {rows[-1]['ratio']:.3f}{control}")
    pooled = {}
    for name in compared:
        for kind in ("wall", "cpu"):
            pooled[name, kind] = harness.median_ratio(
                [x for cap in CAPS for x in times[cap, name][kind]],
                [x for cap in CAPS for x in times[cap, "torch"][kind]])
    all_caps = {"ratio": pooled["miniddp", "wall"][0], "ratio_ci95": pooled["miniddp", "wall"][1],
                "cpu_ratio": pooled["miniddp", "cpu"][0],
                "cpu_ratio_ci95": pooled["miniddp", "cpu"][1]}
    if setup.control:
        all_caps["control_ratio"], all_caps["control_ratio_ci95"] = pooled[CONTROL, "wall"]
    return {"model": harness.model_info(base, setup),
            "batch_per_rank": harness.batch_size(batches),
            **harness.rank_facts(device), "sweep": rows, "all_caps": all_caps}


def plot(result: dict, ax) -> None:
    """Step times per cap; with ``--control``, the ratios to torch's DDP instead, miniddp's
    beside the control's, each with its 95% interval, over a band of +-3%."""
    rows = result["sweep"]
    x = range(len(rows))
    s = result["setup"]
    if s.get("control"):
        ax.axhspan(0.97, 1.03, color="0.9", label="within 3%")
        ax.axhline(1.0, color="0.5", lw=0.8)
        for shift, name, label in ((-0.1, "miniddp", "miniddp / torch"),
                                   (0.1, CONTROL, "torch again / torch (A/A control)")):
            ratios = [r[name]["ratio"] for r in rows]
            err = [[m - r[name]["ratio_ci95"][0] for m, r in zip(ratios, rows)],
                   [r[name]["ratio_ci95"][1] - m for m, r in zip(ratios, rows)]]
            ax.errorbar([i + shift for i in x], ratios, yerr=err, marker="o", ls="none",
                        capsize=3, label=label)
        ylabel = "step time ratio, median of rounds"
    else:
        for name in ("miniddp", "torch"):
            med = [r[name]["median_ms"] for r in rows]
            err = [[m - r[name]["p25_ms"] for m, r in zip(med, rows)],
                   [r[name]["p75_ms"] - m for m, r in zip(med, rows)]]
            ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=name)
        ax.set_ylim(bottom=0)
        ylabel = "step time, median (ms)"
    ax.set_xticks(list(x), [r["bucket_cap_mb"] for r in rows], rotation=30)
    ax.set(xlabel="bucket_cap_mb (MiB)", ylabel=ylabel,
           title=f"{s['backend']}, {s['world_size']} ranks, {s['device']}, {s['model']} model: "
                 f"{result['model']['tensors']} tensors, {result['model']['gradient_mb']} MB")
    ax.legend()


def report(result: dict) -> str:
    control = result["setup"].get("control", False)
    rows = [[r["bucket_cap_mb"], r["buckets"], r["miniddp"]["median_ms"], r["torch"]["median_ms"],
             r["ratio"], "{:.3f}-{:.3f}".format(*r["ratio_ci95"]), r["miniddp"]["cpu_ratio"]]
            + ([r[CONTROL]["ratio"], "{:.3f}-{:.3f}".format(*r[CONTROL]["ratio_ci95"])]
               if control else []) for r in result["sweep"]]
    pooled = result["all_caps"]
    rows.append(["all caps", "", "", "", pooled["ratio"],
                 "{:.3f}-{:.3f}".format(*pooled["ratio_ci95"]), pooled["cpu_ratio"]]
                + ([pooled["control_ratio"], "{:.3f}-{:.3f}".format(*pooled["control_ratio_ci95"])]
                   if control else []))
    return harness.table(["bucket_cap_mb", "buckets", "miniddp ms", "torch ms",
                          "miniddp / torch", "95% interval", "CPU-time ratio"]
                         + (["torch again / torch (A/A)", "95% interval"] if control else []),
                         rows)


def main(argv=None) -> list[dict]:
    return harness.main("bucket_sweep", __doc__, measure, plot, report, argv, pairs=30,
                        models=("wide", "small_tensors"), control=True)


if __name__ == "__main__":
    main()
