"""Overhead: what a Python reducer costs per parameter and per bucket, next to torch's C++ one.

Two models made of many tensors: ``tiny`` (100 Linear(16, 16) layers, 202 tensors, almost no
arithmetic, so a step is nearly all machinery: autograd, a hook per parameter, the copies into
buckets, the all_reduce calls) and ``small_tensors`` (60 Linear(128, 128), 122 tensors of 0.5
to 64 KiB). Timed in turn: the bare module, then miniddp and torch's DDP with one bucket and with
one bucket per parameter. The CPU time of rank 0's main thread is reported beside the step time:
it is what the Python code costs, and it barely depends on the load of the machine. Parameters
must end bit-identical between the two DDPs.

The consistency checks (``miniddp.checks.consistency``) are timed on the one-bucket model too: off
(the plain miniddp above), on with a parameter checksum every 100 steps and every step, and the
debug mode that also compares each collective across ranks. Their parameters must stay
torch's bits.

The floor, what *any* reducer written in Python pays, is timed in the same rounds: the bare
module with an empty Python hook on every parameter's AccumulateGrad node (the hook miniddp
uses), with a hook that does the least a reducer must, one ``torch.mul(grad, 1 / world,
out=bucket_view)``, and with the least a reducer with one bucket per parameter must do: that
copy, an ``all_reduce`` of it launched from the hook, and at the end of backward a wait for
each and one copy of the averages back into ``.grad``. Their CPU time above the bare module's,
per parameter, is the part of miniddp's extra cost that no Python reducer can avoid.

    python benchmarks/overhead.py                       # no GPU: gloo, 2 CPU ranks, 1-2 minutes
    python benchmarks/overhead.py --model small_tensors
    python benchmarks/overhead.py --quick               # smoke run, seconds
"""

from __future__ import annotations

import copy

import harness
import torch
import torch.distributed as dist
from harness import PER_PARAMETER_MB, Trainer, check, summarize
from torch import nn

import miniddp
from course.report import print0

CAPS = {"one_bucket": 100, "per_parameter": PER_PARAMETER_MB}
#: What the floor's Python hooks do (with_python_hooks)
FLOORS = ("empty", "copy", "launch")
#: check_every arguments: (steps between parameter checksums, compare every collective)
CHECKS = {"checksum every 100": (100, False), "checksum every step": (1, False),
          "debug (DETAIL)": (1, True)}


def with_python_hooks(module: nn.Module, work: str) -> nn.Module:
    """``module`` with a Python post-hook on every parameter's AccumulateGrad node that does
    ``work``: ``"empty"`` nothing; ``"copy"`` one multiply into a bucket view; ``"launch"``
    that, and an all_reduce of the view (a bucket per parameter), waited for at the end of
    backward, and the averages copied into ``.grad`` in one call. The nodes are kept on the
    module (see the reducer)."""
    scale = 1.0 / dist.get_world_size()
    group = dist.group.WORLD
    params = list(module.parameters())
    views = [torch.empty_like(p) for p in params]
    launched = []

    def finish():
        for handle in launched:
            handle.wait()
        launched.clear()
        torch._foreach_copy_([p.grad for p in params], views)

    module.nodes = []
    for p, view in zip(params, views):
        node = p.view_as(p).grad_fn.next_functions[0][0]

        def hook(_inputs, _outputs, p=p, view=view):
            if work != "empty":
                torch.mul(p.grad, scale, out=view)
            if work == "launch":
                launched.append(group.allreduce([view]))
                if len(launched) == len(params):
                    torch.autograd.Variable._execution_engine.queue_callback(finish)

        node.register_hook(hook)
        module.nodes.append(node)
    return module


def measure(setup: harness.Setup) -> dict:
    device = harness.rank_device(setup)
    base = harness.make_model(setup, device)
    # one small batch: the machinery, not the arithmetic (a model from outside: its own batch)
    batches = harness.make_batches(setup, device, dist.get_rank(), count=1, size=4)
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
    floors = {work: with_python_hooks(copy.deepcopy(base), work) for work in FLOORS}
    calls = {"local": Trainer(copy.deepcopy(base), batches).step}
    calls.update({f"{work}_hooks": Trainer(m, batches).step for work, m in floors.items()})
    calls.update({f"{label}/{impl}": Trainer(m, batches).step
                  for (label, impl), m in models.items()})
    tensors = len(list(base.parameters()))
    print0(f"  {tensors} parameter tensors, {len(calls)} contestants, {setup.pairs} rounds")
    times = harness.alternate(calls, setup.pairs, device, setup.warmup, "overhead")
    rows = []
    for label in CAPS:
        ours, theirs = models[label, "miniddp"], models[label, "torch"]
        check(harness.identical_models(ours.module, theirs.module, device),
              f"{label}: parameters differ from torch's after the timed steps")
        s = summarize({"miniddp": times[f"{label}/miniddp"],
                       "torch": times[f"{label}/torch"]}, "torch")
        extra_cpu = s["miniddp"]["cpu_median_ms"] - s["torch"]["cpu_median_ms"]
        extra_wall = s["miniddp"]["median_ms"] - s["torch"]["median_ms"]
        rows.append({"buckets": label, "bucket_count": len(ours.buckets), "bit_identical": True,
                     "extra_cpu_us_per_parameter": 1000 * extra_cpu / tensors,
                     "extra_wall_us_per_parameter": 1000 * extra_wall / tensors, **s})
    if dist.get_world_size() == 2:  # (a + b: the same sum whatever the buckets' layout)
        check(harness.identical_models(floors["launch"], models["per_parameter", "torch"].module,
                                         device),
              "the floor's reducer (a bucket per parameter) trained otherwise than torch's DDP")
    bare = summarize({name: times[name] for name in ["local"] + [f"{w}_hooks" for w in FLOORS]})
    floor = {name: 1000 * (bare[name]["cpu_median_ms"] - bare["local"]["cpu_median_ms"]) / tensors
             for name in (f"{work}_hooks" for work in FLOORS)}
    return {"model": harness.model_info(base, setup),
            "batch_per_rank": harness.batch_size(batches),
            **harness.rank_facts(device), "bit_identical": True, "overhead": rows,
            "local": bare["local"], "python_floor": {
                "empty_hook_cpu_us_per_parameter": floor["empty_hooks"],
                "hook_and_copy_cpu_us_per_parameter": floor["copy_hooks"],
                "bucket_per_parameter_cpu_us_per_parameter": floor["launch_hooks"],
                "empty_hooks": bare["empty_hooks"], "copy_hooks": bare["copy_hooks"],
                "launch_hooks": bare["launch_hooks"]},
            "consistency": checks_rows(models, times, device)}


def checks_rows(models: dict, times: dict, device) -> list[dict]:
    """What each setting of the consistency checks adds per step to the one-bucket miniddp."""
    reference = models["one_bucket", "torch"].module
    rows = []
    for label in CHECKS:
        check(harness.identical_models(models["checks", label].module, reference, device),
              f"checks {label}: parameters differ from torch's after the timed steps")
        s = summarize({"checks": times[f"checks/{label}"],
                       "off": times["one_bucket/miniddp"]}, "off")
        rows.append({"setting": label, "bit_identical": True, **s,
                     "extra_ms_per_step": s["checks"]["median_ms"] - s["off"]["median_ms"],
                     "extra_cpu_ms_per_step": (s["checks"]["cpu_median_ms"]
                                               - s["off"]["cpu_median_ms"])})
    return rows


def plot(result: dict, ax) -> None:
    floor = result["python_floor"]
    bare = [("bare module", result["local"]), ("empty hooks", floor["empty_hooks"]),
            ("hooks + copy", floor["copy_hooks"])]
    if "launch_hooks" in floor:  # (results saved before it was measured lack it)
        bare.append(("hooks + copy\n+ all_reduce", floor["launch_hooks"]))
    labels = [label for label, _ in bare]
    walls = [t["median_ms"] for _, t in bare]
    cpus = [t["cpu_median_ms"] for _, t in bare]
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
    ax.set(ylabel="median per step (ms)", title=f"{s['model']} model, "
           f"{result['model']['tensors']} tensors: {s['backend']}, {s['world_size']} ranks, "
           f"{s['device']}")
    ax.legend(fontsize=8)


def report(result: dict) -> str:
    floor = result["python_floor"]
    rows = [[r["buckets"], r["bucket_count"], r["miniddp"]["median_ms"], r["torch"]["median_ms"],
             r["miniddp"]["cpu_median_ms"], r["torch"]["cpu_median_ms"],
             r["extra_cpu_us_per_parameter"]] for r in result["overhead"]]
    return (harness.table(["buckets", "count", "miniddp ms", "torch ms", "miniddp CPU ms",
                           "torch CPU ms", "extra CPU us / parameter"], rows)
            + f"\nbare module: {result['local']['median_ms']:.2f} ms "
              f"({result['local']['cpu_median_ms']:.2f} ms CPU); Python floor per parameter: "
              f"empty hook {floor['empty_hook_cpu_us_per_parameter']:.2f} us, hook + one "
              f"copy {floor['hook_and_copy_cpu_us_per_parameter']:.2f} us, a bucket per "
              f"parameter (copy, all_reduce, wait, copy back) "
              f"{floor.get('bucket_per_parameter_cpu_us_per_parameter', float('nan')):.2f} us "
              "CPU\n"
            + harness.table(["consistency checks", "ms per step", "checks / off",
                             "extra ms per step", "extra CPU ms per step"],
                            [[r["setting"], r["checks"]["median_ms"], r["checks"]["ratio"],
                              r["extra_ms_per_step"], r["extra_cpu_ms_per_step"]]
                             for r in result["consistency"]]))


def main(argv=None) -> list[dict]:
    return harness.main("overhead", __doc__, measure, plot, report, argv, pairs=30,
                        models=("tiny", "small_tensors"))


if __name__ == "__main__":
    main()
