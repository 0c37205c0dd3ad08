"""Lesson 15, part 2: what sharding saves, counted; then ZeRO stage 2, the gradients sharded too.

What this adds since part 1 (``15_sharded_optimizer.py``, whose ``ShardedOptimizer`` it
imports): the memory, and the next step. Part 1 proved that ZeRO-1 gives the unsharded bits;
here its point is counted (no timing) and pushed further.

1. **Memory.** Adam's state on each rank after one step, at 1, 2 and 3 ranks, by hand, in
   miniddp's and in torch's ``ZeroRedundancyOptimizer``, next to total / W: exact for twelve
   equal layers; for lesson 00's student, whose first weight holds most of its elements,
   sharding by whole parameters leaves one rank most of it (FSDP cuts every tensor instead).
2. **ZeRO stage 2.** A rank steps only its share, so it needs only its share's *averaged
   gradients*, and the first half of lesson 01's ring, the reduce-scatter, delivers exactly
   that: lay the gradients out rank by rank, cut the ring's chunks at the shares, and after
   W - 1 exchanges rank r holds the sum of chunk r. Written out here and equal to all_reduce
   then slicing (bit for bit at 2 ranks; at 3 equal to lesson 01's whole ring, and within
   rounding of gloo's all_reduce, which adds in another order), then trained with part 1's
   all_gather in place of DDP. The traffic does not grow: a ring all_reduce *is* a
   reduce-scatter plus an all-gather. Then ZeRO-2 as the libraries ship it,
   ``fully_shard(reshard_after_forward=False)``: miniddp's bit for bit torch's, each rank
   keeping its rows of every gradient, the layers gathered from forward to backward.
3. **Where the stages lead**: bytes per parameter per rank for DDP, ZeRO-1, ZeRO-2 and ZeRO-3
   (FSDP: the weights sharded too, each layer gathered just before it is used; lesson 17).

Run it:

    python lessons/15_sharded_optimizer_stage_2.py              # 2 ranks (and 1, 3 for memory)
    python lessons/15_sharded_optimizer_stage_2.py --nproc 3
    torchrun --standalone --nproc_per_node=2 lessons/15_sharded_optimizer_stage_2.py

What you should see: the state per rank at 1, 2 and 3 ranks equal to torch's and to total / W
for the equal layers; the reduce-scatter's chunk equal to all_reduce then slicing and the
elements each rank sent; ZeRO-2's loss falling, each rank keeping only its share's gradients,
equal to torch's DDP with ZeroRedundancyOptimizer; ``miniddp.fully_shard``'s ZeRO-2 equal to
torch's; the table; ``OK: ...``. About 25 s.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader

import miniddp
from course.data import make_dataset, make_model, shard
from course.report import check, ok, print0
from course.tools import load_lesson
from miniddp.launch import launch, launched_by_torchrun, rank_device
from miniddp.optim import ZeroRedundancyOptimizer

try:  # FSDP2: public from torch 2.6, under _composable before
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
except ImportError:
    try:
        from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard
    except ImportError:
        torch_fully_shard = None

zero1 = load_lesson("15_sharded_optimizer")
ShardedOptimizer, state_bytes, everyone = (zero1.ShardedOptimizer, zero1.state_bytes,
                                           zero1.everyone)
BATCH_SIZE, SAMPLES, TORCHS = zero1.BATCH_SIZE, zero1.SAMPLES, zero1.TORCHS
MEMORY_WORLDS = (1, 2, 3)


# ----- 1. memory per rank at 1, 2, 3 ranks -----

def memory_per_rank() -> list[dict]:
    """Every rank's optimizer state after one Adam step, in bytes: by hand, torch's, unsharded;
    and the model's element count. One dict per rank, on every rank."""
    device = rank_device()
    rows = {}
    for name, build in (("twelve equal layers", zero1.equal_layers),
                        ("lesson 00's student", lambda: make_model(seed=0))):
        models = [build().to(device) for _ in range(4)]
        x = torch.randn(8, models[0][0].in_features, generator=torch.Generator().manual_seed(0))
        optimizers = [ShardedOptimizer(models[0].parameters(), torch.optim.Adam, lr=0.01),
                      TorchZeRO(models[1].parameters(), torch.optim.Adam, lr=0.01),
                      torch.optim.Adam(models[2].parameters(), lr=0.01),
                      ZeroRedundancyOptimizer(models[3].parameters(), torch.optim.Adam, lr=0.01)]
        for model, optimizer in zip(models, optimizers):
            model(x.to(device)).square().mean().backward()
            optimizer.step()
        rows[name] = (state_bytes(optimizers[0].local), state_bytes(optimizers[1].optim),
                      state_bytes(optimizers[2]), sum(p.numel() for p in models[0].parameters()),
                      state_bytes(optimizers[3].optim))
    return everyone(rows)


def show_memory(by_world: dict) -> None:
    print0("\n1. Adam's state on each rank after one step, in bytes, counted (not timed):")
    for name in ("twelve equal layers", "lesson 00's student"):
        total = by_world[min(by_world)][0][name][2]
        print0(f"  {name}: unsharded, every rank holds {total}")
        for world, ranks in sorted(by_world.items()):
            mine, torchs = [r[name][0] for r in ranks], [r[name][1] for r in ranks]
            print0(f"    {world} rank{'s' if world > 1 else ' '}: by hand {mine}, torch's "
                   f"and miniddp's {torchs}; total / W = {total / world:.0f}; the largest "
                   f"share is {max(mine) / total:.0%} of the total")
            check(mine == torchs, f"{name} at {world} ranks: the state held by hand differs "
                                  f"from {TORCHS}'s, rank by rank")
            library = [r[name][4] for r in ranks]
            check(library == torchs, f"{name} at {world} ranks: miniddp's "
                  f"ZeroRedundancyOptimizer holds {library} bytes of state, {TORCHS} {torchs}")
            check(sum(mine) == total and all(r[name][2] == total for r in ranks),
                  f"{name} at {world} ranks: the shares hold {sum(mine)} bytes in all, the "
                  f"unsharded optimizer {total}: each state must be held exactly once")
            if name == "twelve equal layers":
                check(all(m * world == total for m in mine), f"at {world} ranks the equal "
                      f"layers should give every rank total / W = {total / world:g} bytes, got "
                      f"{mine}")
    student = make_model(seed=0)
    print0(f"  The student's first weight holds {max(p.numel() for p in student.parameters())} "
           f"of its {sum(p.numel() for p in student.parameters())} elements: sharded by whole "
           "parameters, no rank\n  holds less than its owner does. (DeepSpeed and FSDP cut one "
           "flat buffer instead.)")


# ----- 2. ZeRO stage 2: reduce-scatter the gradients -----

def ring_reduce_scatter(buffer: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, int]:
    """The first half of lesson 01's ring, with chunks of the given sizes: afterwards this
    rank's chunk holds the sum over the ranks of that chunk. Returns it, and the elements sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(buffer.split(sizes))  # views into buffer
    left, right = (rank - 1) % world, (rank + 1) % world
    sent = 0
    for s in range(world - 1):
        send, add_into = chunks[(rank + 1 + s) % world], chunks[(rank + 2 + s) % world]
        arriving = torch.empty_like(add_into)
        for request in (dist.isend(send.clone(), left), dist.irecv(arriving, right)):
            request.wait()
        torch.add(add_into, arriving, out=add_into)
        sent += send.numel()
    return chunks[rank], sent


def ring_all_gather(buffer: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The second half of lesson 01's ring: each rank's summed chunk goes round."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(buffer.split(sizes))
    left, right = (rank - 1) % world, (rank + 1) % world
    for s in range(world - 1):
        send, overwrite = chunks[(rank + s) % world], chunks[(rank + 1 + s) % world]
        for request in (dist.isend(send.clone(), left), dist.irecv(overwrite, right)):
            request.wait()
    return buffer


def gradients_by_share(sharded: ShardedOptimizer) -> tuple[torch.Tensor, list[int]]:
    """All gradients in one buffer, laid out rank by rank, times 1 / W (torch's arithmetic)."""
    buffer = torch.cat([p.grad.reshape(-1) for share in sharded.shares for p in share])
    return buffer.mul_(1.0 / sharded.world), [sum(p.numel() for p in share)
                                              for share in sharded.shares]


def zero2_step(sharded: ShardedOptimizer) -> int:
    """ZeRO stage 2, after a backward without DDP: reduce-scatter, free the gradients of the
    other shares, then stage 1's step. Returns the gradient elements this rank still holds.

    Backward has computed every gradient by then, so the peak is still DDP's: the freeing
    shows what a rank needs to keep, not yet the memory saved (see section 3)."""
    mine, _ = ring_reduce_scatter(*gradients_by_share(sharded))
    for r, share in enumerate(sharded.shares):
        if r != sharded.rank:
            for p in share:
                p.grad = None  # summed into its owner's chunk: no longer needed here
    share = sharded.shares[sharded.rank]
    for p, part in zip(share, mine.split([p.numel() for p in share])):
        p.grad.copy_(part.view_as(p))
    sharded.step()
    return sum(p.grad.numel() for p in sharded.params if p.grad is not None)


def reduce_scatter_against_all_reduce(rank, world, device):
    model = make_model(seed=0).to(device)
    sharded = ShardedOptimizer(model.parameters(), torch.optim.Adam, "all_gather", lr=0.01)
    x, y = zero1.one_batch(rank, world, device)
    F.mse_loss(model(x), y).backward()
    buffer, sizes = gradients_by_share(sharded)
    mine, sent = ring_reduce_scatter(buffer.clone(), sizes)
    summed, whole_ring = buffer.clone(), buffer.clone()
    dist.all_reduce(summed)
    ring_reduce_scatter(whole_ring, sizes)
    ring_all_gather(whole_ring, sizes)
    start = sum(sizes[:rank])
    sliced, ring_sliced = summed[start:start + sizes[rank]], whole_ring[start:start + sizes[rank]]
    diff = (mine - sliced).abs().max().item() if mine.numel() else 0.0
    print0(f"  the gradients laid out rank by rank, the ring's chunks cut at the shares "
           f"({sizes} elements).\n  Rank 0's chunk after the reduce-scatter equals all_reduce "
           f"then slicing: {torch.equal(mine, sliced)} (largest difference {diff:.1e}); equals "
           f"lesson 01's whole ring then slicing: {torch.equal(mine, ring_sliced)}")
    check(torch.equal(mine, ring_sliced), f"rank {rank}: the reduce-scatter is not the first "
                                          "half of the ring all-reduce")
    if world == 2:
        check(torch.equal(mine, sliced), f"rank {rank}: the reduce-scatter differs from "
                                         f"all_reduce then slicing by {diff:.1e}")
    else:
        print0(f"  (at {world} ranks gloo's all_reduce adds in another order: lesson 01)")
        check(diff <= 1e-6 * summed.abs().max().item(), f"rank {rank}: the reduce-scatter is "
              f"{diff:.1e} from all_reduce then slicing")
    total = sum(sizes)
    check(sent == total - sizes[rank], f"rank {rank} sent {sent} elements in the "
                                       f"reduce-scatter, expected {total - sizes[rank]}")
    every = everyone(sent)
    check(sum(every) == (world - 1) * total, f"the ranks sent {every} elements in the "
          f"reduce-scatter, {sum(every)} in all, expected (W - 1) x {total}")
    print0(f"  The ranks sent {every} elements of {total} (every chunk but their own, once): "
           f"(W-1) x {total}. The all_gather\n  of the parameters sends as many again: a ring "
           "all_reduce's traffic, DDP's. ZeRO-1 as in part 1 sends\n  more: DDP's whole "
           "all_reduce, then every parameter from its owner (1.5x DDP's bytes at the least).")


def stage_two(rank, world, device):
    print0("\n2. ZeRO stage 2: a rank needs the averaged gradients of its own share only")
    reduce_scatter_against_all_reduce(rank, world, device)
    models = [make_model(seed=0).to(device), TorchDDP(make_model(seed=0).to(device))]
    optimizers = [ShardedOptimizer(models[0].parameters(), torch.optim.Adam, "all_gather",
                                   lr=0.01),
                  TorchZeRO(models[1].parameters(), torch.optim.Adam, lr=0.01)]
    loader = DataLoader(shard(make_dataset(n=2 * SAMPLES, seed=0), rank, world),
                        batch_size=BATCH_SIZE, drop_last=True)
    losses, worst, kept = [], 0.0, set()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if model is models[0]:
                kept.add(zero2_step(optimizer))
                losses.append(loss.item())
            else:
                optimizer.step()
        worst = max(worst, (zero1.flat(models[0]) - zero1.flat(models[1])).abs().max().item())
    share = sum(p.numel() for p in optimizers[0].shares[rank])
    check(kept == {share}, f"rank {rank} kept {sorted(kept)} gradient elements after its "
                           f"steps, expected its share's {share}")
    print0(f"  after each step rank 0 keeps the gradients of its share only ({share} of "
           f"{zero1.flat(models[0]).numel()} elements);\n  backward still computed all of them "
           "first, so its peak is DDP's (section 3 says what stage 2 takes)")
    print0(f"  ZeRO-2, no DDP: {len(losses)} steps, rank 0's loss {losses[0]:.4f} -> "
           f"{losses[-1]:.4f}; largest difference from torch's DDP + ZeroRedundancyOptimizer "
           f"{worst:.1e}" + (" (bit for bit: at 2 ranks a + b is b + a)" if world == 2 else
                             " (the ring's order of summation)"))
    check(losses[-1] < 0.2 * losses[0], f"ZeRO-2's loss went from {losses[0]:.4f} to "
                                        f"{losses[-1]:.4f}, not below 20% of it")
    check(worst == 0.0 if world == 2 else worst < 1e-5,
          f"rank {rank}: ZeRO-2 ended {worst:.1e} from torch's DDP + ZeroRedundancyOptimizer")
    library_zero2(rank, world)


def library_zero2(rank, world):
    """ZeRO-2 as the libraries ship it, ``fully_shard(reshard_after_forward=False)``, miniddp's
    beside torch's, bit for bit: each rank keeps its rows of every gradient and parameter, the
    parameters gathered once a step and kept from forward to backward."""
    if torch_fully_shard is None:
        return print0(f"  (torch {torch.__version__} has no fully_shard: ZeRO-2 in the libraries "
                      "not shown)")
    mesh = init_device_mesh("cpu", (world,))
    models = {}
    for name, fully_shard in (("miniddp", miniddp.fully_shard), ("torch", torch_fully_shard)):
        model = make_model(seed=0)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        models[name] = fully_shard(model, mesh=mesh)
    optimizers = {k: torch.optim.Adam(m.parameters(), lr=0.01) for k, m in models.items()}
    x_all, y_all = make_dataset(n=8 * BATCH_SIZE * world, seed=2).tensors
    differ, kept = 0, set()
    for step in range(8):
        x, y = (t[BATCH_SIZE * (world * step + rank):][:BATCH_SIZE] for t in (x_all, y_all))
        local = {}
        for name, model in models.items():
            loss = F.mse_loss(model(x), y)
            kept.add((name, all(not hasattr(m.weight, "to_local") for m in model[::2])))
            loss.backward()
            local[name] = [t.to_local() for p in model.parameters() for t in (p.grad, p)]
            optimizers[name].step()
            optimizers[name].zero_grad()
        differ += sum(int((a != b).sum()) for a, b in zip(local["miniddp"], local["torch"]))
    grads = sum(p.to_local().numel() for p in models["miniddp"].parameters())
    total = sum(p.numel() for p in make_model(seed=0).parameters())
    both = kept == {("miniddp", True), ("torch", True)}
    print0(f"  ZeRO-2 in the libraries, fully_shard(reshard_after_forward=False): rank 0 keeps "
           f"{grads} of {total} gradient\n  elements (its rows of each); the layers stay "
           f"gathered from forward to backward: {both}; miniddp.fully_shard\n  differs from "
           f"torch's in {differ} elements over 8 steps")
    check(both, f"rank {rank}: after forward, with "
          f"reshard_after_forward=False, a layer was freed ({sorted(kept)}): ZeRO-2 keeps "
          "the parameters gathered until backward")
    check(differ == 0, f"rank {rank}: miniddp.fully_shard (ZeRO-2) differs from torch's in "
                       f"{differ} gradient or parameter elements over 8 steps")


# ----- 3. where this leads -----

def stages_table(measured: dict) -> None:
    print0("\n3. Bytes per parameter on each rank, fp32 Adam, and where the stages lead (DDP's "
           "bucket is kept\n   from step to step; stage 2's reduce-scatter buffer and stage 3's "
           "gathered layer are\n   transient, left out):")
    worlds = (1, 2, 3, 8, 64)
    stages = [("DDP", lambda w: 20), ("ZeRO-1 (part 1)", lambda w: 12 + 8 / w),
              ("ZeRO-2 (gradients too)", lambda w: 4 + 12 / w),
              ("ZeRO-3, FSDP (lesson 17)", lambda w: 16 / w)]
    print0(f"  {'':<27}" + "".join(f"{f'W={w}':>8}" for w in worlds))
    for name, per_parameter in stages:
        print0(f"  {name:<27}" + "".join(f"{per_parameter(w):8.2f}" for w in worlds))
    print0("  (ZeRO-2's row needs the reduce-scatter during backward, unit by unit, as "
           "fully_shard makes it;\n  section 2's by hand computes every gradient first.)")
    print0("  measured, ZeRO-1 on twelve equal layers: " + ", ".join(
        f"W={w}: {12 + value:.2f}" for w, value in sorted(measured.items())) +
        " (part 1's 12, and section 1's largest state per element)")
    print0("  ZeRO-3 is the rest of FSDP (fully_shard): lessons/17_fsdp.py gathers each "
           "layer's weights just before\n  its forward and again for its backward.")


def on_every_rank(memory: dict):
    """Sections 1 to 3; ``memory`` holds the state per rank measured at other world sizes."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    print0(f"{world} ranks on {device}")
    memory = {**memory, world: memory_per_rank()}
    show_memory(memory)
    if launched_by_torchrun():
        print0(f"  (under torchrun, only this job's {world} ranks: run it plainly for "
               f"{', '.join(map(str, MEMORY_WORLDS))})")
    stage_two(rank, world, device)
    stages_table({w: max(r["twelve equal layers"][0] for r in ranks) /
                  ranks[0]["twelve equal layers"][3] for w, ranks in memory.items()})
    return world, sorted(memory)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    memory = {} if launched_by_torchrun() else {  # measured first, shown in section 1
        world: launch(memory_per_rank, world)[0] for world in MEMORY_WORLDS if world != args.nproc}
    world, worlds = launch(on_every_rank, args.nproc, args=(memory,))[0]
    ok(f"each rank held 1/W of the optimizer state at {', '.join(map(str, worlds))} ranks, as "
       f"torch's ZeroRedundancyOptimizer does; on {world} ranks the reduce-scatter gave each "
       "rank its share of the averaged gradients, and ZeRO-2 trained like torch's DDP with "
       "ZeroRedundancyOptimizer")


if __name__ == "__main__":
    main()
