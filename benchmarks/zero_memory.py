"""ZeRO-1 memory: the optimizer state each rank keeps, at 1, 2 and 3 ranks, against 1/W.

Adam keeps two moments per parameter (``exp_avg``, ``exp_avg_sq``) plus a step count per
tensor: with plain DDP every rank holds all of it, twice the model. With
``miniddp.ZeroRedundancyOptimizer`` each rank holds the state of its own share of the
parameters, so the prediction is ``(state of one whole Adam) / W`` per rank. The share is made
of whole tensors (torch's greedy partition by size), so a rank can hold a little more than 1/W:
the largest share is what the job must fit, and what is reported against the prediction.

For W = 1, 2, 3 (forked gloo ranks): train the benchmark's wide model a few steps with torch's
DDP and miniddp's ZeroRedundancyOptimizer(Adam), and beside them torch's
ZeroRedundancyOptimizer on a copy; check the parameters are bit-identical, then count on each
rank the bytes of the tensors in the local optimizer's state (each storage once). On a GPU the
allocator's growth across the first step (where the state is created) is recorded too.

    python benchmarks/zero_memory.py           # under a minute on 2 CPU cores
    python benchmarks/zero_memory.py --quick   # smoke run, seconds
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict

import harness
import torch
import torch.distributed as dist
from harness import check
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import miniddp
from course.report import print0, save_figure
from miniddp.launch import launch

WORLD_SIZES = (1, 2, 3)
STEPS = 3
MIB = 2**20


def state_bytes(optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state``, each storage counted once."""
    seen, total = set(), 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if torch.is_tensor(value) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total


def allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def measure(setup: harness.Setup) -> dict:
    device = harness.rank_device(setup)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = harness.make_model(setup, device)
    batches = harness.make_batches(setup, device, rank)
    ours = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **harness.ddp_kwargs(device))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                 **harness.ddp_kwargs(device))
    zero = miniddp.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.Adam, lr=1e-3)
    reference = TorchZero(theirs.parameters(), torch.optim.Adam, lr=1e-3)
    grown = 0
    for step in range(STEPS):
        x, y = batches[step % len(batches)]
        for ddp, opt in ((ours, zero), (theirs, reference)):
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            before = allocated(device)
            opt.step()
            if step == 0 and opt is zero:
                grown = allocated(device) - before
        check(harness.identical_models(ours.module, theirs.module, device),
              f"step {step}: miniddp's ZeRO differs from torch's at {world_size} ranks")
    owned = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
    mine = torch.tensor([state_bytes(zero.optim), state_bytes(reference.optim), owned, grown],
                        dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    rows = [[int(v) for v in t.tolist()] for t in everyone]
    return {"model": harness.model_info(base), **harness.rank_facts(device),
            "world_size": world_size, "bit_identical": True,
            "state_bytes": [r[0] for r in rows], "torch_state_bytes": [r[1] for r in rows],
            "parameters_owned": [r[2] for r in rows],
            "cuda_allocated_in_first_step": [r[3] for r in rows] if device.type == "cuda"
            else None}


def summarize(runs: list[dict]) -> list[dict]:
    """Per world size: the largest share of the state against the whole state / W."""
    whole = runs[0]["state_bytes"][0]  # W = 1 holds everything
    rows = []
    for run in runs:
        w, largest = run["world_size"], max(run["state_bytes"])
        rows.append({"world_size": w, "state_mib_per_rank": [round(b / MIB, 3)
                                                             for b in run["state_bytes"]],
                     "largest_mib": round(largest / MIB, 3),
                     "predicted_mib": round(whole / w / MIB, 3),
                     "largest_over_predicted": round(largest * w / whole, 4),
                     "total_over_whole": round(sum(run["state_bytes"]) / whole, 4),
                     "same_as_torch": run["state_bytes"] == run["torch_state_bytes"]})
    return rows


def plot(result: dict, ax) -> None:
    rows = result["per_world_size"]
    ws = [r["world_size"] for r in rows]
    ax.plot(ws, [r["predicted_mib"] for r in rows], "k--", label="prediction: whole state / W")
    for w, row in zip(ws, rows):
        ax.scatter([w] * w, row["state_mib_per_rank"], color="C0", zorder=3,
                   label="each rank (measured)" if w == 1 else None)
    ax.set(xlabel="ranks (W)", ylabel="Adam state per rank, MiB", xticks=ws,
           title=f"ZeRO-1: optimizer state per rank ({result['model']['parameters']:,} "
                 "parameters)")
    ax.legend(fontsize=8)


def report(result: dict) -> str:
    return harness.table(
        ["ranks", "state per rank (MiB)", "largest", "predicted (1/W)", "largest / predicted",
         "sum / whole", "same bytes as torch's"],
        [[r["world_size"], ", ".join(f"{v:.2f}" for v in r["state_mib_per_rank"]),
          r["largest_mib"], r["predicted_mib"], r["largest_over_predicted"],
          r["total_over_whole"], r["same_as_torch"]] for r in result["per_world_size"]])


def main(argv=None) -> dict:
    args = harness.parse_args(__doc__.splitlines()[0], argv)
    base = harness.setups("zero_memory", args)[0]
    runs, env = [], harness.environment()
    for world_size in WORLD_SIZES:
        gpus = torch.cuda.device_count() if base.device == "cuda" else 0
        backend = "nccl" if base.device == "cuda" and world_size <= gpus else "gloo"
        setup = harness.Setup(**{**asdict(base), "world_size": world_size,
                                 "backend": backend, "launcher": "fork"})
        print0(f"== zero_memory: {setup.device}, {backend}, {world_size} ranks")
        runs.append(launch(measure, world_size, args=(setup,), backend=backend,
                           timeout=args.timeout, pg_timeout=120.0)[0])
    env["load_average_after"] = list(os.getloadavg())
    result = {"benchmark": "zero_memory", "setup": asdict(base), "machine": env,
              "model": runs[0]["model"], "runs": runs, "per_world_size": summarize(runs)}
    tag = f"zero_memory-{base.device}-ws{'-'.join(map(str, WORLD_SIZES))}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    save_figure(tag, lambda ax: plot(result, ax), args.out)
    print0(f"saved {args.out / tag}.json\n{report(result)}")
    return result


if __name__ == "__main__":
    main()
