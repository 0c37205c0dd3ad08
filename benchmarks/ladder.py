"""The ladder: from naive DataParallel to DDP with overlap, step time and all_reduce calls.

Rungs, each a copy of the same model trained on the same data, one step each in turn:

1. ``DataParallel``: one process drives a replica per device (threads), on the whole batch;
   rank 0 runs it while the other ranks wait; it copies the weights every step, no all_reduce;
2. ``per_parameter``: one all_reduce per gradient, after backward;
3. ``buckets_after_backward``: torch's buckets, all_reduced after backward;
4. ``overlap``: miniddp's DDP, buckets all_reduced during backward;
5. ``torch``: torch's DistributedDataParallel.

Checked first: the bucketed rungs end bit-identical to torch's DDP (per-parameter too at world
size 2, where a ring's sum cannot depend on the grouping); DataParallel, whose loss is the same
mean computed in one piece, must have moved the weights where torch's DDP moved them, to float
rounding (relative difference of the updates below 1e-3).

    python benchmarks/ladder.py           # no GPU: gloo, 2 CPU ranks, about a minute
    python benchmarks/ladder.py --quick   # smoke run, seconds
"""

from __future__ import annotations

import copy

import harness
import torch
import torch.distributed as dist
from harness import Trainer, check, summarize
from overlap import no_overlap_question
from torch import nn

import miniddp
from course.report import print0
from miniddp.baselines.naive import STRATEGIES

RUNGS = ["DataParallel", "per_parameter", "buckets_after_backward", "overlap", "torch"]


def data_parallel_rung(setup, base, device):
    """Rank 0's DataParallel on the whole batch (every rank's batch, in rank order)."""
    world = dist.get_world_size()
    devices = [device] * world if device.type == "cpu" or torch.cuda.device_count() < world \
        else [torch.device("cuda", i) for i in range(world)]
    dp = miniddp.DataParallel(copy.deepcopy(base), device_ids=devices)
    per_rank = [harness.make_batches(setup, device, r) for r in range(world)]
    batches = harness.Batches([joined([b[k] for b in per_rank]) for k in range(len(per_rank[0]))],
                              per_rank[0].loss)
    return dp, Trainer(dp, batches)


def joined(parts: list):
    """Every rank's (inputs, target) as one batch: tensors concatenated in rank order."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return type(parts[0])(joined(list(group)) for group in zip(*parts))


def relative_update_error(a: nn.Module, b: nn.Module, start: nn.Module) -> float:
    """|a - b| / |b - start| over all parameters: how far ``a`` moved from where ``b`` moved.
    A wrong gradient (half the batch, unaveraged) gives O(1); float rounding gives ~1e-6."""
    flat = lambda m: torch.cat([p.detach().double().flatten().cpu() for p in m.parameters()])
    return ((flat(a) - flat(b)).norm() / (flat(b) - flat(start)).norm()).item()


def measure(setup: harness.Setup) -> dict:
    device = harness.rank_device(setup)
    rank, world = dist.get_rank(), dist.get_world_size()
    base = harness.make_model(setup, device)
    batches = harness.make_batches(setup, device, rank)
    kwargs = harness.ddp_kwargs(device)
    models = {name: STRATEGIES[name](copy.deepcopy(base), **kwargs)
              for name in ("per_parameter", "buckets_after_backward", "overlap")}
    models["torch"] = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    calls = {name: Trainer(m, batches).step for name, m in models.items()}
    dp = None
    if rank == 0:
        dp, trainer = data_parallel_rung(setup, base, device)
        calls = {"DataParallel": trainer.step, **calls}
    else:
        calls = {"DataParallel": lambda: None, **calls}  # waits at the next step's barrier
    print0(f"  {len(RUNGS)} rungs, {setup.pairs} timed rounds")
    times = harness.alternate(calls, setup.pairs, device, setup.warmup, "ladder")

    theirs = models["torch"]
    correct = {}
    for name in ("per_parameter", "buckets_after_backward", "overlap"):
        exact = harness.identical_models(models[name].module, theirs.module, device)
        check(exact or (name == "per_parameter" and world > 2), f"{name} differs from torch")
        correct[name] = {"bit_identical": exact,
                         "max_abs_diff": harness.max_abs_diff(models[name].module, theirs.module)}
    if rank == 0:
        diff = harness.max_abs_diff(dp.module, theirs.module)
        error = relative_update_error(dp.module, theirs.module, base)
        check(error < 1e-3, f"DataParallel's updates are {error:.3g} away from torch's DDP's")
        correct["DataParallel"] = {"bit_identical": diff == 0.0, "max_abs_diff": diff,
                                   "relative_update_error": error}

    s = summarize(times, "torch")
    calls_per_step = {"DataParallel": 0, "torch": len(harness.torch_layout(theirs)),
                      **{name: models[name].allreduce_calls for name in
                         ("per_parameter", "buckets_after_backward", "overlap")}}
    rows = [{"rung": name, "allreduce_calls": calls_per_step[name], **correct.get(name, {}),
             **s[name]} for name in RUNGS]
    rows[0]["weight_bytes_copied_per_step"] = dp.last_forward.param_bytes_copied if dp else 0
    saved = harness.median_ratio(times["overlap"]["wall"], times["buckets_after_backward"]["wall"])
    result = {"model": harness.model_info(base, setup),
              "batch_per_rank": harness.batch_size(batches),
              **harness.rank_facts(device), "ladder": rows,
              "nothing_to_overlap": no_overlap_question(world)}
    if not result["nothing_to_overlap"]:  # else the ratio is the machinery's cost alone
        result.update({"overlap_vs_after_backward": saved[0],
                       "overlap_vs_after_backward_ci95": saved[1]})
    return result


def plot(result: dict, ax) -> None:
    rows = result["ladder"]
    y = range(len(rows))
    med = [r["median_ms"] for r in rows]
    err = [[m - r["p25_ms"] for m, r in zip(med, rows)],
           [r["p75_ms"] - m for m, r in zip(med, rows)]]
    ax.barh(y, med, xerr=err, capsize=3, color="tab:blue")
    ax.set_yticks(list(y), [f"{r['rung']}\n{r['allreduce_calls']} all_reduce/step"
                            for r in rows], fontsize=8)
    ax.invert_yaxis()
    s = result["setup"]
    ax.set(xlabel="step time, median (ms)",
           title=f"{s['backend']}, {s['world_size']} ranks, {s['device']}, "
                 f"{result['model']['gradient_mb']} MB of gradients")


def report(result: dict) -> str:
    rows = [[r["rung"], r["allreduce_calls"], r["median_ms"], r.get("ratio", 1.0),
             r.get("bit_identical", "-")] for r in result["ladder"]]
    table = harness.table(["rung", "all_reduce / step", "step ms", "vs torch (per round)",
                           "bit-identical to torch"], rows)
    if result.get("nothing_to_overlap"):
        return table + f"\noverlap / buckets after backward: not asked ({rung_note(result)})"
    return (table + "\noverlap / buckets after backward (median of per-round ratios): "
            f"{result['overlap_vs_after_backward']:.3f}")


def rung_note(result: dict) -> str:
    return result["nothing_to_overlap"].replace("no hidden fraction", "the overlap rung only "
                                                "measures the machinery's cost")


def main(argv=None) -> list[dict]:
    return harness.main("ladder", __doc__, measure, plot, report, argv, pairs=20)


if __name__ == "__main__":
    main()
