"""miniddp's fully_shard against torch's FSDP2: step time (A B A B, ratios) and memory per rank.

Both shard the same model the same way (``fully_shard`` on each Linear + LayerNorm + ReLU block,
then on the root; ZeRO-3) and train it with SGD on the same per-rank batches, one step each per
round in a changing order (``harness.alternate``); the reported figure is the median of the
per-round ratios miniddp / torch (goal: within 5%). Before any number is saved, every rank's
parameter shards of the two are checked bit-identical.

Memory per rank: on CUDA, the allocator's peak during one step of each (run alone, after the
timing); on the CPU, which has no allocator statistics, the bytes held at rest after a step:
parameter shards, gradient shards and optimizer state (each storage once). ZeRO-3 divides those
by the world size, which is what the figure shows.

``--hsdp``: HSDP on 2 "nodes" of W/2 ranks (default W = 4), miniddp's beside torch's on the
same 2-D mesh, with torch's timed twice in the same rounds (an A/A control: the ratio of torch's
to itself says how far a ratio is to be trusted here), and both FSDPs over all W ranks beside
them; bits checked first, each HSDP's and each FSDP's against torch's.

    python benchmarks/fsdp.py                 # 2 and 3 gloo ranks on the CPU, a few minutes
    python benchmarks/fsdp.py --hsdp          # 2 x 2 gloo ranks on the CPU
    python benchmarks/fsdp.py --quick         # smoke run, seconds
    python benchmarks/fsdp.py --device cuda   # NCCL, one rank per GPU (bash benchmarks/gpu.sh)
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

import harness
import torch
import torch.distributed as dist
from harness import check
from torch import nn

import miniddp
from course.report import print0, save_figure
from course.tools import sync
from miniddp.checks.bits import same_bits
from miniddp.launch import launch, launched_by_torchrun

try:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
except ImportError:
    try:
        from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard
    except ImportError:
        torch_fully_shard = None

CPU_WORLD_SIZES = (2, 3)
MIB = 2**20


def blocks_model(setup: harness.Setup, device: torch.device) -> nn.Module:
    """The harness's ``wide`` model as blocks (Linear, LayerNorm, ReLU), the unit of sharding."""
    torch.manual_seed(0)
    widths = harness.WIDTHS[setup.size]
    blocks = [nn.Sequential(nn.Linear(a, b), nn.LayerNorm(b), nn.ReLU())
              for a, b in zip(widths, widths[1:])]
    return nn.Sequential(*blocks, nn.Linear(widths[-1], harness.OUT_FEATURES)).to(device)


def sharded(model: nn.Module, shard, device: torch.device, mesh=None) -> nn.Module:
    """Each block, then the root, over ``mesh``, by default a 1-D mesh of every rank on
    ``device`` (torch's default mesh is the GPU wherever there is one, even for a CPU run)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = mesh or init_device_mesh(device.type, (dist.get_world_size(),))
    for block in list(model)[:-1]:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def bytes_at_rest(trainer: harness.Trainer) -> int:
    """Parameter shards, gradient shards and optimizer state on this rank, each storage once."""
    tensors = []
    for p in trainer.model.parameters():
        tensors += [local(p), local(p.grad) if p.grad is not None else None]
    for state in trainer.opt.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def peak_bytes(trainer: harness.Trainer, device: torch.device) -> int:
    """The CUDA allocator's peak during one step, above what was allocated before it."""
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    trainer.step()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def measure(setup: harness.Setup) -> dict:
    device = harness.rank_device(setup)
    rank = dist.get_rank()
    batches = harness.make_batches(setup, device, rank)
    trainers = {name: harness.Trainer(sharded(blocks_model(setup, device), shard, device),
                                      batches)
                for name, shard in (("miniddp", miniddp.fully_shard),
                                    ("torch", torch_fully_shard))}
    times = harness.alternate({name: t.step for name, t in trainers.items()}, setup.pairs,
                              device, setup.warmup, label=f"fsdp ws{setup.world_size}")
    ours, theirs = (list(trainers[n].model.parameters()) for n in ("miniddp", "torch"))
    equal = all(same_bits(local(a).detach(), local(b).detach())
                for a, b in zip(ours, theirs))
    check(harness.slowest_rank([0.0 if equal else 1.0], device)[0] == 0.0,
          f"miniddp's FSDP and torch's differ after training at {setup.world_size} ranks")
    memory = {name: (peak_bytes(t, device) if device.type == "cuda" else bytes_at_rest(t))
              for name, t in trainers.items()}
    everyone = harness.slowest_rank([float(memory["miniddp"]), float(memory["torch"])],
                                      device)
    per_rank = [torch.zeros(2, dtype=torch.float64, device=harness.collective_device(device))
                for _ in range(setup.world_size)]
    dist.all_gather(per_rank, torch.tensor([float(memory["miniddp"]), float(memory["torch"])],
                                           dtype=torch.float64,
                                           device=harness.collective_device(device)))
    full = blocks_model(setup, torch.device("cpu"))
    info = {**harness.model_info(full), "widths": [*harness.WIDTHS[setup.size],
                                                   harness.OUT_FEATURES]}
    return {"model": info, **harness.rank_facts(device),
            "world_size": setup.world_size, "backend": setup.backend, "bit_identical": True,
            "step": harness.summarize(times, baseline="torch"),
            "memory_kind": "cuda allocator peak in one step" if device.type == "cuda"
            else "bytes at rest: parameter and gradient shards, optimizer state",
            "memory_mib_per_rank": {name: [round(r[i].item() / MIB, 3) for r in per_rank]
                                    for i, name in enumerate(("miniddp", "torch"))},
            "memory_mib_largest": {"miniddp": round(everyone[0] / MIB, 3),
                                   "torch": round(everyone[1] / MIB, 3)}}


def per_rank_mib(values: dict, device: torch.device) -> dict[str, list[float]]:
    """Every rank's ``values`` (name -> bytes), in MiB, rank by rank."""
    mine = torch.tensor([float(v) for v in values.values()], dtype=torch.float64,
                        device=harness.collective_device(device))
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return {name: [round(r[i].item() / MIB, 3) for r in everyone]
            for i, name in enumerate(values)}


HSDP_RUNS = ("miniddp HSDP", "torch HSDP", "torch HSDP again", "miniddp FSDP", "torch FSDP")


def measure_hsdp(setup: harness.Setup) -> dict:
    """HSDP on 2 nodes of W/2 ranks, miniddp's beside torch's (twice: the A/A control), and
    both FSDPs over every rank, timed in the same rounds."""
    from torch.distributed.device_mesh import init_device_mesh

    device, world = harness.rank_device(setup), dist.get_world_size()
    mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    batches = harness.make_batches(setup, device, dist.get_rank())
    shards = {"miniddp": miniddp.fully_shard, "torch": torch_fully_shard}
    trainers = {name: harness.Trainer(sharded(blocks_model(setup, device),
                                              shards[name.split()[0]], device,
                                              mesh if "HSDP" in name else None), batches)
                for name in HSDP_RUNS}
    times = harness.alternate({name: t.step for name, t in trainers.items()}, setup.pairs,
                              device, setup.warmup, label=f"hsdp 2x{world // 2}")
    params = {name: list(t.model.parameters()) for name, t in trainers.items()}
    equal = all(same_bits(local(a).detach(), local(b).detach())
                for ours, theirs in (("miniddp HSDP", "torch HSDP"), ("torch HSDP again",
                                                                      "torch HSDP"),
                                     ("miniddp FSDP", "torch FSDP"))
                for a, b in zip(params[ours], params[theirs]))
    check(harness.slowest_rank([0.0 if equal else 1.0], device)[0] == 0.0,
          f"an HSDP or FSDP differs from torch's after training at 2 x {world // 2} ranks")
    full = blocks_model(setup, torch.device("cpu"))
    return {"model": {**harness.model_info(full), "widths": [*harness.WIDTHS[setup.size],
                                                             harness.OUT_FEATURES]},
            **harness.rank_facts(device), "world_size": world, "mesh": [2, world // 2],
            "backend": setup.backend, "bit_identical": True,
            "step": harness.summarize(times, baseline="torch HSDP"),
            "memory_kind": "bytes at rest: parameter and gradient shards, optimizer state",
            "memory_mib_per_rank": per_rank_mib({n: bytes_at_rest(t)
                                                 for n, t in trainers.items()}, device)}


def hsdp_report(run: dict) -> str:
    step, memory = run["step"], run["memory_mib_per_rank"]
    rows = [[name, round(step[name]["median_ms"], 2),
             round(step[name]["ratio"], 3) if "ratio" in step[name] else 1.0,
             ", ".join(f"{v:.2f}" for v in step[name].get("ratio_ci95", [1, 1])),
             max(memory[name])] for name in HSDP_RUNS]
    return harness.table(["", "step ms", "/ torch HSDP", "95% interval", "MiB/rank"], rows)


def plot(result: dict, ax) -> None:
    runs = result["runs"]
    ws = [r["world_size"] for r in runs]
    ratios = [r["step"]["miniddp"]["ratio"] for r in runs]
    low = [r - r_["step"]["miniddp"]["ratio_ci95"][0] for r, r_ in zip(ratios, runs)]
    high = [r_["step"]["miniddp"]["ratio_ci95"][1] - r for r, r_ in zip(ratios, runs)]
    ax.errorbar(ws, ratios, yerr=[low, high], fmt="o", capsize=4, label="miniddp / torch step")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhspan(0.95, 1.05, color="C2", alpha=0.15, label="within 5%")
    ax.set(xlabel="ranks", ylabel="step time, miniddp / torch (median of rounds)", xticks=ws,
           title=f"FSDP (ZeRO-3) vs torch's FSDP2, {result['device']}")
    ax.legend(fontsize=8)


def report(result: dict) -> str:
    rows = []
    for r in result["runs"]:
        step = r["step"]
        rows.append([r["world_size"], round(step["miniddp"]["median_ms"], 2),
                     round(step["torch"]["median_ms"], 2), round(step["miniddp"]["ratio"], 3),
                     ", ".join(f"{v:.2f}" for v in r["step"]["miniddp"]["ratio_ci95"]),
                     r["memory_mib_largest"]["miniddp"], r["memory_mib_largest"]["torch"]])
    return harness.table(["ranks", "miniddp ms", "torch ms", "ratio", "ratio 95% CI",
                          "miniddp MiB/rank", "torch MiB/rank"], rows)


def main_hsdp(args, base: harness.Setup) -> dict:
    world_size = args.world_size or 4
    setup = harness.Setup(**{**asdict(base), "world_size": world_size, "backend": "gloo",
                             "launcher": "fork", "benchmark": "fsdp-hsdp"})
    print0(f"== hsdp: {setup.device}, gloo, 2 x {world_size // 2} ranks")
    run = launch(measure_hsdp, world_size, args=(setup,), backend="gloo", timeout=args.timeout,
                 pg_timeout=120.0)[0]
    env = {**harness.environment(), "load_average_after": list(os.getloadavg())}
    result = {"benchmark": "fsdp-hsdp", "setup": asdict(setup), "device": setup.device,
              "machine": env, "model": run["model"], "runs": [run]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{setup.tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print0(f"saved {path}\n{hsdp_report(run)}")
    return result


def main(argv=None) -> dict:
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--hsdp", action="store_true")
    known, rest = mode.parse_known_args(argv)
    args = harness.parse_args(__doc__.splitlines()[0], rest, pairs=12)
    if torch_fully_shard is None:
        raise SystemExit("this torch has no FSDP2 (fully_shard) to compare with")
    base = harness.setups("fsdp", args)[0]
    if known.hsdp:
        return main_hsdp(args, base)
    gpus = torch.cuda.device_count() if base.device == "cuda" else 0
    if launched_by_torchrun():
        sizes = [int(os.environ["WORLD_SIZE"])]
    elif gpus:
        sizes = [args.world_size or gpus]
    else:
        sizes = [args.world_size] if args.world_size else list(CPU_WORLD_SIZES)
    runs, env = [], harness.environment()
    for world_size in sizes:
        backend = args.backend or ("nccl" if 0 < world_size <= gpus else "gloo")
        setup = harness.Setup(**{**asdict(base), "world_size": world_size, "backend": backend,
                                 "launcher": "fork"})
        print0(f"== fsdp: {setup.device}, {backend}, {world_size} ranks")
        runs.append(launch(measure, world_size, args=(setup,), backend=backend,
                           timeout=args.timeout, pg_timeout=120.0)[0])
    env["load_average_after"] = list(os.getloadavg())
    result = {"benchmark": "fsdp", "setup": asdict(base), "device": base.device,
              "machine": env, "model": runs[0]["model"], "runs": runs}
    tag = f"fsdp-{base.device}-{runs[0]['backend']}-ws{'-'.join(map(str, sizes))}"
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        return result
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    save_figure(tag, lambda ax: plot(result, ax), args.out)
    print0(f"saved {args.out / tag}.json\n{report(result)}")
    return result


if __name__ == "__main__":
    main()
