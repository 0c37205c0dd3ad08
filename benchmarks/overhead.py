"""Overhead: what a Python reducer costs per parameter and per bucket, next to torch's C++ one.

A model of 100 tiny Linear layers (200 parameter tensors, 16 x 16) does almost no arithmetic,
so a step's time is nearly all machinery: autograd, the hook per parameter, the copies into
buckets and the all_reduce calls. Timed in turn: the bare module, then miniddp and torch's DDP
with one bucket and with one bucket per parameter. The CPU time of rank 0's main thread is
reported beside the step time: it is what the Python code costs, and it barely depends on the
load of the machine. Parameters must end bit-identical between the two DDPs.

The consistency checks (``miniddp.consistency``) are timed on the one-bucket model too: off
(the plain miniddp above), on with a parameter checksum every 100 steps and every step, and the
debug mode that also compares each collective across ranks. Their parameters must stay
torch's bits.

    python benchmarks/overhead.py           # no GPU: gloo, 2 CPU ranks, under a minute
    python benchmarks/overhead.py --quick   # smoke run, seconds
"""

from __future__ import annotations

import copy

import harness
import torch
import torch.distributed as dist
from harness import PER_PARAMETER_MB, Trainer, check, summarize
from torch import nn

import miniddp
from miniddp.report import print0

CAPS = {"one_bucket": 100, "per_parameter": PER_PARAMETER_MB}
#: check_every arguments: (steps between parameter checksums, compare every collective)
CHECKS = {"checksum every 100": (100, False), "checksum every step": (1, False),
          "debug (DETAIL)": (1, True)}


def tiny_model(layers: int, device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)],
                         nn.Linear(16, harness.OUT_FEATURES)).to(device)


def measure(setup: harness.Setup) -> dict:
    device = harness.rank_device(setup)
    base = tiny_model(20 if setup.quick else 100, device)
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [(torch.randn(4, 16, generator=g).to(device),
                torch.randn(4, harness.OUT_FEATURES, generator=g).to(device))]
    kwargs = harness.ddp_kwargs(device)
    models = {}
    for label, cap in CAPS.items():
        models[label, "miniddp"] = miniddp.DistributedDataParallel(
            copy.deepcopy(base), bucket_cap_mb=cap, **kwargs)
        models[label, "torch"] = nn.parallel.DistributedDataParallel(
            copy.deepcopy(base), bucket_cap_mb=cap, **kwargs)
    for label, (every, detail) in CHECKS.items():
        checked = miniddp.DistributedDataParallel(copy.deepcopy(base),
                                                  bucket_cap_mb=CAPS["one_bucket"], **kwargs)
        checked.check_every(every, detail=detail)
        models["checks", label] = checked
    calls = {"local": Trainer(copy.deepcopy(base), batches).step}
    calls.update({f"{label}/{impl}": Trainer(m, batches).step
                  for (label, impl), m in models.items()})
    tensors = len(list(base.parameters()))
    print0(f"  {tensors} parameter tensors, {len(calls)} contestants, {setup.pairs} rounds")
    times = harness.alternate(calls, setup, device, "overhead")
    rows = []
    for label in CAPS:
        ours, theirs = models[label, "miniddp"], models[label, "torch"]
        check(harness.same_bits(ours.module, theirs.module, device),
              f"{label}: parameters differ from torch's after the timed steps")
        s = summarize({"miniddp": times[f"{label}/miniddp"],
                       "torch": times[f"{label}/torch"]}, "torch")
        extra_cpu = s["miniddp"]["cpu_median_ms"] - s["torch"]["cpu_median_ms"]
        extra_wall = s["miniddp"]["median_ms"] - s["torch"]["median_ms"]
        rows.append({"buckets": label, "bucket_count": len(ours.buckets), "bit_identical": True,
                     "extra_cpu_us_per_parameter": 1000 * extra_cpu / tensors,
                     "extra_wall_us_per_parameter": 1000 * extra_wall / tensors, **s})
    return {"model": harness.model_info(base), "batch_per_rank": 4,
            **harness.rank_facts(device), "bit_identical": True, "overhead": rows,
            "local": summarize({"local": times["local"]})["local"],
            "consistency": checks_rows(models, times, device)}


def checks_rows(models: dict, times: dict, device) -> list[dict]:
    """What each setting of the consistency checks adds per step to the one-bucket miniddp."""
    reference = models["one_bucket", "torch"].module
    rows = []
    for label in CHECKS:
        check(harness.same_bits(models["checks", label].module, reference, device),
              f"checks {label}: parameters differ from torch's after the timed steps")
        s = summarize({"checks": times[f"checks/{label}"],
                       "off": times["one_bucket/miniddp"]}, "off")
        rows.append({"setting": label, "bit_identical": True, **s,
                     "extra_ms_per_step": s["checks"]["median_ms"] - s["off"]["median_ms"],
                     "extra_cpu_ms_per_step": (s["checks"]["cpu_median_ms"]
                                               - s["off"]["cpu_median_ms"])})
    return rows


def plot(result: dict, ax) -> None:
    labels, walls, cpus = ["bare module"], [result["local"]["median_ms"]], \
        [result["local"]["cpu_median_ms"]]
    for r in result["overhead"]:
        for impl in ("miniddp", "torch"):
            labels.append(f"{impl}\n{r['buckets'].replace('_', ' ')}")
            walls.append(r[impl]["median_ms"])
            cpus.append(r[impl]["cpu_median_ms"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], walls, 0.4, label="step time")
    ax.bar([i + 0.2 for i in x], cpus, 0.4, label="CPU time, rank 0 main thread")
    ax.set_xticks(list(x), labels, fontsize=7)
    s = result["setup"]
    ax.set(ylabel="median per step (ms)", title=f"{result['model']['tensors']} tiny tensors: "
           f"{s['backend']}, {s['world_size']} ranks, {s['device']}")
    ax.legend(fontsize=8)


def report(result: dict) -> str:
    rows = [[r["buckets"], r["bucket_count"], r["miniddp"]["median_ms"], r["torch"]["median_ms"],
             r["miniddp"]["cpu_median_ms"], r["torch"]["cpu_median_ms"],
             r["extra_cpu_us_per_parameter"]] for r in result["overhead"]]
    return (harness.table(["buckets", "count", "miniddp ms", "torch ms", "miniddp CPU ms",
                           "torch CPU ms", "extra CPU us / parameter"], rows)
            + f"\nbare module: {result['local']['median_ms']:.2f} ms "
              f"({result['local']['cpu_median_ms']:.2f} ms CPU)\n"
            + harness.table(["consistency checks", "ms per step", "checks / off",
                             "extra ms per step", "extra CPU ms per step"],
                            [[r["setting"], r["checks"]["median_ms"], r["checks"]["ratio"],
                              r["extra_ms_per_step"], r["extra_cpu_ms_per_step"]]
                             for r in result["consistency"]]))


def main(argv=None) -> list[dict]:
    return harness.main("overhead", __doc__, measure, plot, report, argv, pairs=30)


if __name__ == "__main__":
    main()
