"""Lesson 17: FSDP by hand (ZeRO stage 3), bit for bit torch's ``fully_shard``.

What this adds since lesson 15: the parameters and gradients are sharded too, not only the
optimizer state: lesson 15's "ZeRO-3, FSDP: 16/W bytes per parameter", written out in about 100
lines (``Unit`` and ``Gathered``). Each rank keeps only its chunk of every tensor's rows,
``torch.chunk(t, W)``'s cut (ceil(rows / W) rows, fewer or none for the last ranks). A unit
(here one ``nn.Linear``; in torch one ``fully_shard`` call) is then driven like this:

1. **forward**: all-gather the unit's shards, each padded to chunk 0's size, in one collective;
   compute; **free** the gathered weights (autograd keeps only where they were: a saved-tensor
   hook), so a rank holds one unit's full weights at a time, never the model's;
2. **backward**: **gather again** where backward needs the weights; **reduce-scatter** the
   gradients in one collective: row r of a (W, n) buffer holds chunk r of every gradient,
   padded (torch's layout); rank r receives the sum of the rows r, then **divides by W**;
3. **step**: an ordinary optimizer over the shards, as in lesson 15.

Proven after every backward and step, on every rank: the gradient and parameter shards by hand
equal torch's ``fully_shard`` and ``miniddp.fully_shard`` bit for bit. Then what decides those
bits, each broken on purpose: 1/W before the sum (DDP's way), the gradients laid out whole one
after another (FSDP1's), the chunks not padded. Gloo sums a buffer in W equal pieces, each in
another order, so an element's place decides its rounding: at 3 ranks every mistake changes
bits, at 2 none does (a + b is b + a). Last, the bytes per rank at 1, 2 and 3 ranks: DDP,
ZeRO-1 and FSDP.

Run it:

    python lessons/17_fsdp.py              # 3 ranks (and 1, 2 for the memory)
    python lessons/17_fsdp.py --nproc 2    # where every mistake still agrees
    torchrun --standalone --nproc_per_node=3 lessons/17_fsdp.py

What you will see: 0 elements differing from torch's, by hand and miniddp's, over 8 Adam steps,
the loss falling; how often each unit was gathered; each mistake's differing elements; the bytes
per rank; ``OK: ...``. About 25 s on two CPU cores. It needs torch's FSDP2 (torch 2.4 or later):
on an older torch it prints ``SKIPPED: ...``. Part 2, ``17_fsdp_options.py``, runs the library's
``fully_shard`` on every other path (ZeRO-2, mixed precision, accumulation, clipping).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import miniddp
from course.data import IN_FEATURES, OUT_FEATURES, make_dataset
from course.report import check, mean_over_ranks, ok, print0
from miniddp.launch import launch, launched_by_torchrun
from miniddp.optim import ZeroRedundancyOptimizer

try:  # FSDP2: public from torch 2.6, under _composable before
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
except ImportError:
    try:
        from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard
    except ImportError:
        torch_fully_shard = None

HIDDEN = 40  # 40 rows cut in 3: 14, 14, 12 (the last chunk padded); the last weight's 4: 2, 2, 0
STEPS, BATCH, ADAM, MEMORY_WORLDS = 8, 16, dict(lr=0.01), (1, 2, 3)


def make_model() -> nn.Module:
    """Three layers, the same on every rank and in every run."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                             nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))


# ----- FSDP by hand -----

# (output, input): named all_gather_single and reduce_scatter_single from torch 2.13 on
gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """The rows ``torch.chunk(t, world)`` gives ``rank``: ceil(rows / world), or fewer, or none."""
    rows = -(-t.shape[0] // world)
    return t[rank * rows:(rank + 1) * rows]


def padded(piece: torch.Tensor, rows: int) -> torch.Tensor:
    """``piece`` with rows of zeros below it up to ``rows``, flattened."""
    return torch.cat([piece, piece.new_zeros(rows - len(piece), *piece.shape[1:])]).reshape(-1)


class Unit:
    """One module's parameters, cut on dim 0: gathered, and reduce-scattered, in one collective."""

    group = None  # the ranks that shard: every rank (lesson 18 shards inside a node)

    def __init__(self, module: nn.Module):
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.names, self.shapes = zip(*[(n, p.shape) for n, p in module.named_parameters()])
        self.rows = [-(-s[0] // self.world) for s in self.shapes]  # every chunk padded to these
        self.sizes = [r * s[1:].numel() for r, s in zip(self.rows, self.shapes)]
        self.shards = [nn.Parameter(chunk(module._parameters.pop(n).detach(), self.world,
                                          self.rank).clone()) for n in self.names]
        self.module, self.full, self.gathers = module, None, 0
        module.forward = self.sharded(module.forward)

    def gather(self) -> list[torch.Tensor]:
        """All-gather: every rank's padded shards, one flat buffer in, (W, n) out."""
        self.gathers += 1
        mine = torch.cat([padded(s.detach(), r) for s, r in zip(self.shards, self.rows)])
        out = mine.new_empty(self.world, mine.numel())
        gather_into(out.view(-1), mine, group=self.group)
        parts = zip(*[row.split(self.sizes) for row in out])  # per parameter, per rank
        return [torch.cat(p).view(-1, *s[1:])[:s[0]] for p, s in zip(parts, self.shapes)]

    def layout(self, grads) -> torch.Tensor:
        """The reduce-scatter's input: row r holds chunk r of every gradient, each padded."""
        return torch.cat([padded(chunk(g, self.world, r), rows) for r in range(self.world)
                          for g, rows in zip(grads, self.rows)])

    def mine(self, row: torch.Tensor) -> list[torch.Tensor]:
        """This rank's row of the layout, cut back into unpadded shards."""
        return [part[:s.numel()].view_as(s) for part, s in zip(row.split(self.sizes), self.shards)]

    def reduce_scatter(self, grads) -> list[torch.Tensor]:
        """This rank's shard of every gradient, summed over the ranks, then divided by W."""
        buffer = self.layout(grads)
        out = buffer.new_empty(buffer.numel() // self.world)
        reduce_scatter_into(out, buffer, group=self.group)
        return self.mine(out.div_(self.world))  # after the sum, as gloo's AVG does

    def sharded(self, forward):
        def gather_compute_free(*args):
            self.full = Gathered.apply(self, *self.shards)
            for name, tensor in zip(self.names, self.full):
                setattr(self.module, name, tensor)
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                out = forward(*args)
            for name in self.names:
                setattr(self.module, name, None)
            self.full = None  # freed: backward gathers again
            return out
        return gather_compute_free

    def pack(self, t: torch.Tensor):
        """What autograd keeps for backward: of a gathered parameter (or a view), only where."""
        for i, full in enumerate(self.full or ()):
            if t.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
                return i, t.shape, t.stride(), t.storage_offset()
        return t

    def unpack(self, saved):
        if not torch.is_tensor(saved) and self.full is None:
            self.full = self.gather()  # again, for backward
        return saved if torch.is_tensor(saved) else self.full[saved[0]].as_strided(*saved[1:])


class Gathered(torch.autograd.Function):
    """Forward: the gathered parameters. Backward: their gradients, reduce-scattered."""

    @staticmethod
    def forward(ctx, unit, *shards):
        ctx.unit = unit
        return tuple(unit.gather())

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.full = None  # the gathered parameters are freed again
        return (None, *ctx.unit.reduce_scatter(grads))


def by_hand(model: nn.Module, unit=Unit) -> tuple[nn.Module, list[Unit]]:
    return model, [unit(m) for m in model if isinstance(m, nn.Linear)]  # a unit per layer


def shard_with(fully_shard, model: nn.Module) -> nn.Module:
    """torch's call shape, each block then the root, on the CPU (torch's default: a GPU)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in [m for m in model if isinstance(m, nn.Linear)] + [model]:
        fully_shard(m, mesh=mesh)
    return model


# ----- 1. FSDP by hand beside torch's fully_shard and miniddp's -----

def differing(ours, theirs) -> int:  # torch's and miniddp's shards are DTensor-like
    local = [[t.to_local() if hasattr(t, "to_local") else t for t in ts] for ts in (ours, theirs)]
    return sum(int((a != b).sum()) for a, b in zip(*local))


def batches(rank: int, world: int, steps: int):
    x, y = make_dataset(n=BATCH * world * steps, seed=0).tensors
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(BATCH * rank, len(x), BATCH * world)]


def side_by_side(rank: int, world: int) -> list[float]:
    """Every gradient and parameter shard of each FSDP, after every backward and step, against
    torch's. Returns the mean losses."""
    model, units = by_hand(make_model())
    runs = {"by hand": (model, [s for u in units for s in u.shards])}
    for name, fully_shard in (("miniddp.fully_shard", miniddp.fully_shard),
                              ("torch's fully_shard", torch_fully_shard)):
        runs[name] = (sharded := shard_with(fully_shard, make_model()), list(sharded.parameters()))
    optimizers = {k: torch.optim.Adam(params, **ADAM) for k, (_, params) in runs.items()}
    theirs, losses, differ = runs["torch's fully_shard"][1], [], dict.fromkeys(runs, 0)
    for x, y in batches(rank, world, STEPS):
        for name, (m, _) in runs.items():
            optimizers[name].zero_grad()
            loss = F.mse_loss(m(x), y)
            check(all(u.full is None for u in units), "after forward a unit still holds its "
                  "gathered parameters: FSDP frees them until backward")
            loss.backward()
            losses += [loss.detach()] * (name == "by hand")
        for name, (_, params) in runs.items():  # torch's last: stepped after it is compared
            differ[name] += differing([p.grad for p in params], [p.grad for p in theirs])
            optimizers[name].step()
        differ = {name: n + differing(runs[name][1], theirs) for name, n in differ.items()}
    gathers = [u.gathers for u in units]
    print0(f"  all-gathers per unit in {STEPS} steps: {gathers} (the first layer's weight is "
           "not needed\n  in backward: its input needs no gradient)")
    check(gathers == [STEPS] + [2 * STEPS] * (len(units) - 1), f"rank {rank}: the units gathered"
          f" {gathers} times in {STEPS} steps, not in forward and again in backward")
    for name, count in list(differ.items())[:-1]:
        print0(f"  {name:<21} differs from torch's fully_shard in {count} elements")
        check(count == 0, f"rank {rank}: {name} differs from torch's fully_shard in {count} "
                          f"gradient or parameter elements over {STEPS} steps")
    return [mean_over_ranks(loss) for loss in losses]


# ----- 2. each detail that decides the bits, broken on purpose -----

class Broken(Unit):
    """FSDP by hand with one mistake in the reduce-scatter: the same sums, other roundings.
    Each sums with all_reduce and keeps this rank's part: gloo's reduce-scatter, bit for bit."""

    MISTAKES = ("1/W before the sum (DDP's arithmetic)",
                "the flat layout (every gradient whole, one after another: FSDP1's)",
                "no padding (each rank's chunks one after another, rows of unequal length)")

    def reduce_scatter(self, grads) -> list[torch.Tensor]:
        first, flat = (self.mistake == m for m in self.MISTAKES[:2])
        pieces = (self.layout(grads).mul_(1 / self.world).split(sum(self.sizes)) if first else
                  [g.reshape(-1) for g in grads] if flat else
                  [chunk(g, self.world, r).reshape(-1) for r in range(self.world) for g in grads])
        summed = torch.cat(pieces)
        dist.all_reduce(summed)
        summed = summed.div_(1 if first else self.world).split([p.numel() for p in pieces])
        if first:
            return self.mine(summed[self.rank])
        if flat:
            return [chunk(g.view(shape), self.world, self.rank).view_as(s)
                    for g, shape, s in zip(summed, self.shapes, self.shards)]
        return [g.view_as(s) for g, s in zip(summed[self.rank * len(grads):], self.shards)]


def broken_details(rank: int, world: int) -> dict[str, int]:
    """One backward of each broken variant, beside torch's: gradient elements that differ."""
    x, y = batches(rank, world, 1)[0]
    torchs, counted = shard_with(torch_fully_shard, make_model()), {}
    F.mse_loss(torchs(x), y).backward()
    for mistake in Broken.MISTAKES:
        model, units = by_hand(make_model(), type("Broken", (Broken,), {"mistake": mistake}))
        F.mse_loss(model(x), y).backward()
        count = torch.tensor(differing([s.grad for u in units for s in u.shards],
                                       [p.grad for p in torchs.parameters()]))
        dist.all_reduce(count)
        counted[mistake] = int(count)
    return counted


# ----- 3. memory per rank: DDP, ZeRO-1, FSDP -----

def memory_per_rank() -> list[dict]:
    """After one Adam step, every rank's bytes of parameters, gradients and Adam's moments (its
    step counts, 4 bytes a tensor on every rank, left out) under DDP, ZeRO-1 and FSDP."""
    (x, y), rows = batches(dist.get_rank(), dist.get_world_size(), 1)[0], {}
    ddp, zero = (miniddp.DistributedDataParallel(make_model()) for _ in range(2))
    fsdp, units = by_hand(make_model())
    for name, model, params, optimizer in (
            ("DDP", ddp, list(ddp.parameters()), torch.optim.Adam(ddp.parameters(), **ADAM)),
            ("ZeRO-1", zero, list(zero.parameters()),
             ZeroRedundancyOptimizer(zero.parameters(), torch.optim.Adam, **ADAM)),
            ("FSDP", fsdp, shards := [s for u in units for s in u.shards],
             torch.optim.Adam(shards, **ADAM))):
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        moments = [t for state in getattr(optimizer, "optim", optimizer).state.values()
                   for k, t in state.items() if k != "step"]
        rows[name] = tuple(sum(t.numel() * t.element_size() for t in ts)
                           for ts in (params, [p.grad for p in params], moments))
    dist.all_gather_object(everyone := [None] * dist.get_world_size(), rows)
    return everyone


def show_memory(by_world: dict) -> None:
    print0("\n3. Bytes each rank holds between steps (Adam, fp32): weights + gradients + state")
    params = list(make_model().parameters())
    n = sum(p.numel() for p in params)
    for world, ranks in sorted(by_world.items()):
        print0(f"  {world} rank{'s' if world > 1 else ''}:")
        for name in ("DDP", "ZeRO-1", "FSDP"):
            print0(f"    {name:<7}" + "  ".join(f"{'+'.join(map(str, r[name])):>19} = "
                                                  f"{sum(r[name]):>6}" for r in ranks))
        chunks = [sum(chunk(p.detach(), world, r).numel() for p in params) for r in range(world)]
        got = {name: [r[name] for r in ranks] for name in ("DDP", "ZeRO-1", "FSDP")}
        check(got["DDP"] == [(4 * n, 4 * n, 8 * n)] * world and
              [r[:2] for r in got["ZeRO-1"]] == [(4 * n, 4 * n)] * world and
              sum(r[2] for r in got["ZeRO-1"]) == 8 * n and
              got["FSDP"] == [(4 * c, 4 * c, 8 * c) for c in chunks], f"at {world} ranks the "
              f"bytes held are {got}: DDP should hold everything, ZeRO-1 each moment once, FSDP "
              f"16 bytes per element of each rank's chunks {chunks}")
    print0("  FSDP: 16 bytes per element of a rank's chunks (rank 2 of 3 has the short ones). "
           "While a unit computes,\n  its rank also holds that unit's gathered weights and "
           "gradients: one unit's, never the model's.")


# ----- the lesson -----

def on_every_rank(memory: dict):
    rank, world = dist.get_rank(), dist.get_world_size()
    print0(f"{world} ranks, gloo on the CPU, {sum(p.numel() for p in make_model().parameters())}"
           f" parameters\n\n1. FSDP by hand beside torch's fully_shard, Adam, {STEPS} steps:")
    losses = side_by_side(rank, world)
    print0("  loss (mean over the ranks): " + " ".join(f"{loss:.4f}" for loss in losses))
    check(losses[-1] < 0.5 * losses[0], f"the loss fell from {losses[0]} to {losses[-1]} only")
    print0(f"\n2. One detail broken at a time, {world} ranks: gradient elements that differ "
           "from torch's\n   after one backward (from 3 ranks on: at 2, a + b is b + a)")
    for mistake, count in broken_details(rank, world).items():
        print0(f"  {mistake:<76} {count:>5}")
        check((count > 0) == (world >= 3), f"at {world} ranks '{mistake}' differs from torch's "
              f"in {count} elements: expected some from 3 ranks on, none at 2 (a + b is b + a)")
    show_memory(memory := {**memory, world: memory_per_rank()})
    return {"world": world, "losses": (losses[0], losses[-1]), "memory": sorted(memory)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=3, help="ranks to fork (not under torchrun)")
    args = parser.parse_args()
    if torch_fully_shard is None:
        return print(f"SKIPPED: lesson 17 needs torch's FSDP2, {torch.__version__} has none")
    memory = {} if launched_by_torchrun() else {  # measured first, shown in section 3
        w: launch(memory_per_rank, w, backend="gloo")[0] for w in MEMORY_WORLDS if w != args.nproc}
    result = launch(on_every_rank, args.nproc, args=(memory,), backend="gloo")[0]
    first, last = result["losses"]
    ok(f"on {result['world']} ranks FSDP by hand equals torch's fully_shard bit for bit (loss "
       f"{first:.3f} -> {last:.4f}); each broken detail differs from 3 ranks on; FSDP holds 1/W of "
       f"the bytes at {', '.join(map(str, result['memory']))} ranks")


if __name__ == "__main__":
    main()
