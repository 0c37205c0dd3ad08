"""Lesson 17: FSDP by hand (ZeRO stage 3), bit for bit torch's ``fully_shard``.

What this adds since lesson 15: the parameters and gradients are sharded too, not only the
optimizer state. Lesson 15's table ends at "ZeRO-3, FSDP: 16/W bytes per parameter"; here it is,
in about 100 lines (``Unit`` and ``Gathered``), and then counted. Each rank keeps, for every
tensor, only its chunk of rows: ``torch.chunk(t, W)``, chunks of ceil(rows / W) rows, so the
last ranks get fewer rows or none. A unit (here one ``nn.Linear``; in torch one ``fully_shard``
call) is then driven like this:

1. **forward**: all-gather the unit's shards, each padded to the chunk size, in one collective;
   compute; **free** the gathered weights (autograd keeps only where they were: a saved-tensor
   hook), so a rank holds one unit's full weights at a time, never the model's;
2. **backward**: **gather again** where backward needs the weights; the gradients of the whole
   weights come out, and are **reduce-scattered** in one collective: row r of a (W, n) buffer
   holds chunk r of every gradient, padded (torch's layout), the ranks' rows are summed and rank
   r keeps row r, then **divides by W** (torch sums first, as gloo's AVG does);
3. **step**: an ordinary optimizer over the shards: each element's update reads only its own
   gradient and state, as in lesson 15.

Proven here, after every backward and every step, on every rank: the gradient and parameter
shards by hand equal torch's ``fully_shard`` (and ``miniddp.fully_shard``) bit for bit. Then
what decides those bits, each broken on purpose: scaling by 1/W before the sum (DDP's way), the
gradients laid out whole one after another (FSDP1's flat parameter), the chunks not padded.
Gloo's all_reduce (which its reduce-scatter is) cuts the buffer in W equal pieces and sums each
piece in another order, so an element's place decides its rounding: at 3 ranks every mistake
changes bits, at 2 none does (a + b is b + a, halving is exact). Last, the bytes each rank
holds, counted on the objects at 1, 2 and 3 ranks: DDP, ZeRO-1 (lesson 15) and FSDP.

Run it:

    python lessons/17_fsdp.py              # 3 ranks (and 1, 2 for the memory)
    python lessons/17_fsdp.py --nproc 2    # where every mistake still agrees
    torchrun --standalone --nproc_per_node=3 lessons/17_fsdp.py

What you will see: "0 elements" differing from torch's fully_shard for the hand-written FSDP
(and miniddp's) over 8 Adam steps, the loss falling; how often each unit was gathered; each
broken detail's count of differing gradient elements; a table of parameter, gradient and state
bytes per rank, FSDP's 16 bytes per element of a rank's chunks; and ``OK: ...``. About 10-20
seconds on two CPU cores. It needs torch's FSDP2 (torch 2.4 or later): on an older torch it
prints ``SKIPPED: ...`` and ``run_course.py`` lists it as skipped.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import miniddp
from miniddp.launch import launch, launched_by_torchrun
from miniddp.optim import ZeroRedundancyOptimizer
from miniddp.train.data import IN_FEATURES, OUT_FEATURES, make_dataset
from miniddp.train.report import check, mean_over_ranks, ok, print0

try:  # FSDP2: public from torch 2.6, under _composable before
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
except ImportError:
    try:
        from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard
    except ImportError:
        torch_fully_shard = None

HIDDEN = 40  # 40 rows cut in 3: 14, 14, 12 (the last chunk padded); the last weight's 4: 2, 2, 0
STEPS, BATCH = 8, 16
ADAM = dict(lr=0.01)
MEMORY_WORLDS = (1, 2, 3)


def make_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                             nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))


# ----- FSDP by hand -----

def gather_into(output: torch.Tensor, shard: torch.Tensor) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, shard)


def reduce_scatter_into(output: torch.Tensor, buffer: torch.Tensor) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, buffer)


def chunk(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """The rows ``torch.chunk(t, world)`` gives ``rank``: ceil(rows / world) of them, fewer or
    none for the last ranks."""
    rows = -(-t.shape[0] // world)
    return t[rank * rows:(rank + 1) * rows]


def padded(piece: torch.Tensor, rows: int) -> torch.Tensor:
    """``piece`` with rows of zeros below it up to ``rows``, flattened."""
    return torch.cat([piece, piece.new_zeros(rows - len(piece), *piece.shape[1:])]).reshape(-1)


class Unit:
    """One module's parameters, each cut on dim 0: FSDP's unit, gathered and reduce-scattered
    in one collective each."""

    def __init__(self, module: nn.Module):
        self.rank, self.world, self.module = dist.get_rank(), dist.get_world_size(), module
        self.names, self.shapes = zip(*[(n, p.shape) for n, p in module.named_parameters()])
        self.rows = [-(-s[0] // self.world) for s in self.shapes]  # chunk 0's, padded to
        self.sizes = [r * s[1:].numel() for r, s in zip(self.rows, self.shapes)]
        self.shards = [nn.Parameter(chunk(module._parameters.pop(n).detach(), self.world,
                                          self.rank).clone()) for n in self.names]
        self.full, self.gathers = None, 0
        module.forward = self.sharded(module.forward)

    def gather(self) -> list[torch.Tensor]:
        """All-gather: every rank's padded shards, one flat buffer in, (W, n) out."""
        self.gathers += 1
        mine = torch.cat([padded(s.detach(), r) for s, r in zip(self.shards, self.rows)])
        out = mine.new_empty(self.world, mine.numel())
        gather_into(out.view(-1), mine)
        parts = zip(*[row.split(self.sizes) for row in out])  # per parameter, per rank
        return [torch.cat(p).view(-1, *shape[1:])[:shape[0]] for p, shape in zip(parts,
                                                                                  self.shapes)]

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
        reduce_scatter_into(out, buffer)
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
        if torch.is_tensor(saved):
            return saved
        if self.full is None:
            self.full = self.gather()  # again, for backward
        i, shape, stride, offset = saved
        return self.full[i].as_strided(shape, stride, offset)


class Gathered(torch.autograd.Function):
    """Forward: the gathered parameters. Backward: their gradients, reduce-scattered."""

    @staticmethod
    def forward(ctx, unit, *shards):
        ctx.unit = unit
        return tuple(unit.gather())

    @staticmethod
    def backward(ctx, *grads):
        unit, ctx.unit.full = ctx.unit, None  # the gathered parameters are freed again
        return (None, *unit.reduce_scatter([torch.zeros(shape) if g is None else g
                                            for g, shape in zip(grads, unit.shapes)]))


def by_hand(model: nn.Module, unit=Unit) -> tuple[nn.Module, list[Unit]]:
    return model, [unit(m) for m in model if isinstance(m, nn.Linear)]


def shard_with(fully_shard, model: nn.Module) -> nn.Module:
    """torch's call shape: each block first, then the root."""
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


# ----- 1. FSDP by hand beside torch's fully_shard and miniddp's -----

def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient: torch's are DTensors, the others plain."""
    return t.to_local() if hasattr(t, "to_local") else t


def differing(ours, theirs) -> int:
    return sum(int((local(a) != local(b)).sum()) for a, b in zip(ours, theirs))


def batches(rank: int, world: int, steps: int):
    x, y = make_dataset(n=BATCH * world * steps, seed=0).tensors
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(BATCH * rank, len(x), BATCH * world)]


def side_by_side(rank: int, world: int) -> list[float]:
    """The FSDPs on the same batches; every gradient shard after every backward, and every
    parameter shard after every step, compared with torch's. Returns the mean losses."""
    model, units = by_hand(make_model())
    runs = {"by hand": (model, [s for u in units for s in u.shards])}
    for name, fully_shard in (("miniddp.fully_shard", getattr(miniddp, "fully_shard", None)),
                              ("torch's fully_shard", torch_fully_shard)):
        if fully_shard is not None:
            runs[name] = (shard_with(fully_shard, make_model()), None)
    runs = {k: (m, params or list(m.parameters())) for k, (m, params) in runs.items()}
    optimizers = {k: torch.optim.Adam(params, **ADAM) for k, (_, params) in runs.items()}
    theirs, losses, differ = runs["torch's fully_shard"][1], [], dict.fromkeys(runs, 0)
    for x, y in batches(rank, world, STEPS):
        for name, (m, _) in runs.items():
            optimizers[name].zero_grad()
            loss = F.mse_loss(m(x), y)
            losses += [loss.detach()] if name == "by hand" else []
            check(all(u.full is None for u in units), "after forward a unit still holds its "
                  "gathered parameters: FSDP frees them until backward")
            loss.backward()
        for name, (_, params) in runs.items():
            differ[name] += differing([p.grad for p in params], [p.grad for p in theirs])
            optimizers[name].step()
        for name, (_, params) in runs.items():
            differ[name] += differing(params, theirs)
    gathers = [u.gathers for u in units]
    print0(f"  all-gathers per unit in {STEPS} steps: {gathers} (the first layer's weight is "
           "not needed\n  in backward: its input needs no gradient)")
    check(gathers == [STEPS] + [2 * STEPS] * (len(units) - 1), f"rank {rank}: the units "
          f"gathered {gathers} times in {STEPS} steps, expected once in forward and, where "
          "backward needs the weights, again in backward")
    for name, count in list(differ.items())[:-1]:
        print0(f"  {name:<21} differs from torch's fully_shard in {count} elements")
        check(count == 0, f"rank {rank}: {name} differs from torch's fully_shard in {count} "
                          f"gradient or parameter elements over {STEPS} steps")
    return [mean_over_ranks(loss) for loss in losses]


# ----- 2. each detail that decides the bits, broken on purpose -----

class Broken(Unit):
    """FSDP by hand with one mistake in the reduce-scatter: the same sums, other roundings."""

    MISTAKES = ("1/W before the sum (DDP's arithmetic)",
                "the flat layout (every gradient whole, one after another: FSDP1's)",
                "no padding (each rank's chunks one after another, rows of unequal length)")
    mistake = None

    def reduce_scatter(self, grads) -> list[torch.Tensor]:
        if self.mistake == self.MISTAKES[0]:
            buffer = self.layout(grads).mul_(1 / self.world)
            out = buffer.new_empty(buffer.numel() // self.world)
            reduce_scatter_into(out, buffer)
            return self.mine(out)
        # The other two cut the buffer elsewhere than at equal rows: all_reduce then slice
        # (what gloo's reduce-scatter does; reduce_scatter_tensor refuses unequal rows)
        pieces = ([g.reshape(-1) for g in grads] if self.mistake == self.MISTAKES[1] else
                  [chunk(g, self.world, r).reshape(-1) for r in range(self.world) for g in grads])
        summed = torch.cat(pieces)
        dist.all_reduce(summed)
        summed = summed.div_(self.world).split([p.numel() for p in pieces])
        if self.mistake == self.MISTAKES[1]:
            return [chunk(g.view(shape), self.world, self.rank).view_as(s)
                    for g, shape, s in zip(summed, self.shapes, self.shards)]
        return [g.view_as(s) for g, s in zip(summed[self.rank * len(grads):], self.shards)]


def broken_details(rank: int, world: int) -> dict[str, int]:
    """One backward of each broken variant, beside torch's: gradient elements that differ."""
    x, y = batches(rank, world, 1)[0]
    torchs = shard_with(torch_fully_shard, make_model())
    F.mse_loss(torchs(x), y).backward()
    counted = {}
    for mistake in Broken.MISTAKES:
        model, units = by_hand(make_model(), type("Broken", (Broken,), {"mistake": mistake}))
        F.mse_loss(model(x), y).backward()
        count = torch.tensor(differing([s.grad for u in units for s in u.shards],
                                       [p.grad for p in torchs.parameters()]))
        dist.all_reduce(count)
        counted[mistake] = int(count)
    return counted


# ----- 3. memory per rank: DDP, ZeRO-1, FSDP -----

def held(params, optimizer) -> tuple[int, int, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds between steps; of
    Adam's state the moments, not its step counts (4 bytes per tensor, on every rank)."""
    state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    return tuple(sum(t.numel() * t.element_size() for t in ts)
                 for ts in (params, [p.grad for p in params], state))


def memory_per_rank() -> list[dict]:
    """After one Adam step: what each rank holds under DDP, ZeRO-1 and FSDP (by hand)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batches(rank, world, 1)[0]
    ddp, zero = (miniddp.DistributedDataParallel(make_model()) for _ in range(2))
    fsdp, units = by_hand(make_model())
    shards = [s for u in units for s in u.shards]
    runs = {"DDP": (ddp, list(ddp.parameters()), torch.optim.Adam(ddp.parameters(), **ADAM)),
            "ZeRO-1": (zero, list(zero.parameters()),
                       ZeroRedundancyOptimizer(zero.parameters(), torch.optim.Adam, **ADAM)),
            "FSDP": (fsdp, shards, torch.optim.Adam(shards, **ADAM))}
    rows = {}
    for name, (model, params, optimizer) in runs.items():
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        rows[name] = held(params, getattr(optimizer, "optim", optimizer))
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    return everyone


def show_memory(by_world: dict) -> None:
    print0("\n3. Bytes each rank holds between steps (Adam, fp32), counted on the objects:\n"
           "   parameters + gradients + optimizer state")
    params = list(make_model().parameters())
    n = sum(p.numel() for p in params)
    for world, ranks in sorted(by_world.items()):
        print0(f"  {world} rank{'s' if world > 1 else ''}:")
        for name in ("DDP", "ZeRO-1", "FSDP"):
            print0(f"    {name:<7}" + "  ".join(f"{'+'.join(map(str, r[name])):>19} = "
                                                  f"{sum(r[name]):>6}" for r in ranks))
        mine = [sum(chunk(p.detach(), world, r).numel() for p in params) for r in range(world)]
        expected = {"DDP": [(4 * n, 4 * n, 8 * n)] * world,
                    "FSDP": [(4 * c, 4 * c, 8 * c) for c in mine]}  # each part sharded
        for name, rows in expected.items():
            check([r[name] for r in ranks] == rows, f"{name} at {world} ranks holds "
                  f"{[r[name] for r in ranks]} bytes, expected {rows}")
        check(all(r["ZeRO-1"][:2] == (4 * n, 4 * n) for r in ranks) and
              sum(r["ZeRO-1"][2] for r in ranks) == 8 * n, f"ZeRO-1 at {world} ranks should "
              "keep every weight and gradient on every rank and each moment on one")
    print0("  FSDP: 16 bytes per element of a rank's chunks (4 weight, 4 gradient, 8 moments). "
           "At 3 ranks rank 2\n  holds less: torch.chunk leaves it the short last chunk of "
           "every tensor, and none of the last weight.\n  While a unit computes, its rank also "
           "holds that unit's gathered weights and gradients: one unit's, not the model's.")


# ----- the lesson -----

def on_every_rank(memory: dict):
    rank, world = dist.get_rank(), dist.get_world_size()
    print0(f"{world} ranks, gloo on the CPU; a model of {len(make_model())} layers, "
           f"{sum(p.numel() for p in make_model().parameters())} parameters\n")
    print0(f"1. FSDP by hand beside torch's fully_shard, Adam, {STEPS} steps:")
    losses = side_by_side(rank, world)
    print0("  loss (mean over the ranks): " + " ".join(f"{loss:.4f}" for loss in losses))
    check(losses[-1] < 0.5 * losses[0], f"the loss went from {losses[0]:.4f} to "
                                        f"{losses[-1]:.4f}, not below half of it")
    print0(f"\n2. One detail broken at a time, {world} ranks: gradient elements that differ "
           "from torch's\n   after one backward")
    for mistake, count in broken_details(rank, world).items():
        print0(f"  {mistake:<76} {count:>5}")
        if world >= 3:
            check(count > 0, f"at {world} ranks '{mistake}' gave torch's gradients bit for bit: "
                             "the lesson no longer shows what decides the bits")
        else:
            check(count == 0, f"at {world} ranks '{mistake}' differs from torch's")
    if world < 3:
        print0("  (at 2 ranks a + b is b + a and halving is exact: every variant agrees. Run "
               "with --nproc 3)")
    memory = {**memory, world: memory_per_rank()}
    show_memory(memory)
    return {"world": world, "losses": (losses[0], losses[-1]), "memory": sorted(memory)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=3,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    if torch_fully_shard is None:
        print(f"SKIPPED: this lesson compares with torch's FSDP2 (fully_shard), which torch "
              f"{torch.__version__} does not have")
        return
    memory = {} if launched_by_torchrun() else {
        world: launch(memory_per_rank, world)[0] for world in MEMORY_WORLDS if world != args.nproc}
    result = launch(on_every_rank, args.nproc, args=(memory,))[0]
    first, last = result["losses"]
    ok(f"on {result['world']} ranks FSDP by hand equals torch's fully_shard bit for bit (loss "
       f"{first:.3f} -> {last:.4f}); each broken detail differs; FSDP holds 1/W of the bytes at "
       f"{', '.join(map(str, result['memory']))} ranks")


if __name__ == "__main__":
    main()
