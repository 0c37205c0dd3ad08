"""Overlap: how much of the communication hides behind backward, in miniddp and torch's DDP.

Timed in turn, one step each:

* ``miniddp`` / ``torch``: a normal synchronized training step;
* ``miniddp_compute`` / ``torch_compute``: the same step with the forward inside ``no_sync``
  (forward, backward and optimizer step, no communication), on copies of their own;
* ``communication``: an all_reduce of every bucket (same sizes, same order, launched
  asynchronously, then waited for), and nothing else;
* ``after_backward``: miniddp's buckets all_reduced only after backward (the same work, serial);
* ``local``: the bare module without DDP, for the wrapper's own cost.

Round by round (all seven are timed within seconds of each other), then the median over rounds:
hidden = compute + communication - step, the part of communication that did not add to the
step (copying gradients into and out of buckets counts against it); the ideal step is
max(compute, communication); ``overlap_saves_ms`` = after_backward - miniddp step;
``miniddp_hides_more_ms`` = miniddp's hidden - torch's hidden, with a 95% interval.

    python benchmarks/overlap.py           # no GPU: gloo, 2 CPU ranks, about a minute
    python benchmarks/overlap.py --quick   # smoke run, seconds
"""

from __future__ import annotations

import copy
import functools
import statistics

import harness
import torch
import torch.distributed as dist
from harness import Trainer, check, summarize
from torch.nn.parallel import DistributedDataParallel as DDP

import miniddp
from course.report import print0
from miniddp.baselines.naive import AllReduceBucketsAfterBackward


def all_reduce_buckets(buffers: list[torch.Tensor]):
    def communicate():
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for work in works:
            work.wait()
    return communicate


def measure(setup: harness.Setup) -> dict:
    device = harness.rank_device(setup)
    base = harness.make_model(setup, device)
    batches = harness.make_batches(setup, device, dist.get_rank())
    kwargs = harness.ddp_kwargs(device)
    # Synced steps and no_sync steps on separate copies: each set stays comparable bit for bit.
    models = {"miniddp": miniddp.DistributedDataParallel, "torch": DDP,
              "after_backward": AllReduceBucketsAfterBackward,
              "miniddp_compute": miniddp.DistributedDataParallel, "torch_compute": DDP}
    models = {name: cls(copy.deepcopy(base), **kwargs) for name, cls in models.items()}
    trainers = {name: Trainer(model, batches) for name, model in models.items()}
    for _ in range(2):  # step 0 uses one bucket; the real buckets exist from step 1 on
        for name in ("miniddp", "torch", "after_backward"):
            trainers[name].step()
    buffers = [torch.zeros(bucket.numel, device=device) for bucket in models["miniddp"].buckets]
    calls = {name: trainers[name].step for name in ("miniddp", "torch", "after_backward")}
    calls.update({name: functools.partial(trainers[name].step, sync=False)
                  for name in ("miniddp_compute", "torch_compute")})
    calls["communication"] = all_reduce_buckets(buffers)
    calls["local"] = Trainer(copy.deepcopy(base), batches).step
    print0(f"  {len(calls)} measurements, {len(buffers)} buckets, {setup.pairs} timed rounds")
    times = harness.alternate(calls, setup.pairs, device, setup.warmup, "overlap")
    check(harness.ours_layout(models["miniddp"]) == harness.torch_layout(models["torch"]),
          "miniddp's buckets differ from torch's")
    for a, b in (("miniddp", "torch"), ("after_backward", "torch"),
                 ("miniddp_compute", "torch_compute")):
        check(harness.identical_models(models[a].module, models[b].module, device),
              f"{a}: parameters differ from {b}'s after the timed steps")

    s = summarize(times, "torch")
    wall = {name: t["wall"] for name, t in times.items()}
    comm = wall["communication"]
    impls, hidden = {}, {}
    nothing = no_overlap_question(dist.get_world_size())
    for name in ("miniddp", "torch"):
        compute, step = wall[f"{name}_compute"], wall[name]
        # round by round: the three were timed within seconds of each other, under one load
        hidden[name] = [c + m - t for c, m, t in zip(compute, comm, step)]
        fraction = harness.median_ci([h / m for h, m in zip(hidden[name], comm)])
        impls[name] = {"compute_ms": statistics.median(compute),
                       "communication_ms": statistics.median(comm),
                       "step_ms": statistics.median(step),
                       "ideal_ms": statistics.median(max(c, m) for c, m in zip(compute, comm)),
                       "serial_ms": statistics.median(c + m for c, m in zip(compute, comm))}
        if not nothing:
            impls[name].update({"hidden_ms": statistics.median(hidden[name]),
                                "hidden_fraction": fraction[0],
                                "hidden_fraction_ci95": fraction[1]})
    result = {"model": harness.model_info(base, setup),
              "batch_per_rank": harness.batch_size(batches),
              **harness.rank_facts(device), "buckets": len(buffers),
              "bucket_mb": [round(x.numel() * x.element_size() / 2**20, 2) for x in buffers],
              "bit_identical": True, "impls": impls, "nothing_to_overlap": nothing,
              "compute_ratio": harness.median_ratio(wall["miniddp_compute"],
                                                    wall["torch_compute"])[0],
              "times": s}
    if not nothing:
        more = harness.median_ci([a - b for a, b in zip(hidden["miniddp"], hidden["torch"])])
        saves = harness.median_ci([a - b for a, b in zip(wall["after_backward"],
                                                         wall["miniddp"])])
        result.update({"miniddp_hides_more_ms": more[0], "miniddp_hides_more_ms_ci95": more[1],
                       "overlap_saves_ms": saves[0], "overlap_saves_ms_ci95": saves[1]})
    return result


def no_overlap_question(world_size: int) -> str | None:
    """Why overlap cannot be measured here, or None. At world size 1 an all_reduce sends
    nothing: "communication" is a kernel launch or a copy, and overlapping it with backward
    hides nothing; what is left is the cost of the machinery (see ladder and bucket_sweep)."""
    if world_size > 1:
        return None
    return ("world size 1: there is no communication to hide, so no hidden fraction; on one "
            "GPU only the 2-rank gloo setup asks the overlap question")


def plot(result: dict, ax) -> None:
    parts = [("compute_ms", "compute only"), ("communication_ms", "communication only"),
             ("serial_ms", "compute + communication"), ("step_ms", "actual step"),
             ("ideal_ms", "max(compute, communication)")]
    names = list(result["impls"])
    width = 0.8 / len(parts)
    for k, (key, label) in enumerate(parts):
        ax.bar([i + k * width for i in range(len(names))],
               [result["impls"][n][key] for n in names], width, label=label)
    nothing = result.get("nothing_to_overlap")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))],
                  [n if nothing else
                   f"{n}\n{100 * result['impls'][n]['hidden_fraction']:.0f}% of comm. hidden"
                   for n in names])
    s = result["setup"]
    ax.set(ylabel="median (ms)", title=f"{s['backend']}, {s['world_size']} ranks, "
                                       f"{s['device']}, {result['buckets']} buckets"
                                       + ("\nnothing to overlap at world size 1" if nothing
                                          else ""))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))


def report(result: dict) -> str:
    local = result["times"]["local"]["median_ms"]
    keys = ["compute_ms", "communication_ms", "step_ms", "ideal_ms"]
    headers = ["DDP", "compute ms", "communication ms", "step ms", "ideal ms"]
    if result.get("nothing_to_overlap"):
        rows = [[name] + [v[k] for k in keys] for name, v in result["impls"].items()]
        return (harness.table(headers, rows)
                + f"\nbare module, no DDP: {local:.1f} ms; miniddp / torch step (per round): "
                  f"{result['times']['miniddp']['ratio']:.3f}\nno hidden fraction: "
                  f"{result['nothing_to_overlap']}")
    keys += ["hidden_ms", "hidden_fraction"]
    rows = [[name] + [v[k] for k in keys] for name, v in result["impls"].items()]
    return (harness.table(headers + ["hidden ms", "hidden fraction"], rows)
            + f"\nbare module, no DDP: {local:.1f} ms; miniddp / torch step (per round): "
              f"{result['times']['miniddp']['ratio']:.3f}; miniddp hides "
              f"{result['miniddp_hides_more_ms']:.1f} ms more than torch "
              "({:.1f} to {:.1f}); ".format(*result["miniddp_hides_more_ms_ci95"])
            + f"overlap saves {result['overlap_saves_ms']:.1f} ms against the same buckets "
              "reduced after backward")


def main(argv=None) -> list[dict]:
    return harness.main("overlap", __doc__, measure, plot, report, argv, pairs=20)


if __name__ == "__main__":
    main()
