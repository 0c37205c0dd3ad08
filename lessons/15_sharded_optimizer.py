"""Lesson 15: after DDP, shard the optimizer: ZeRO stage 1 by hand, bit for bit torch's.

What this adds since lesson 14: a way to stop repeating the optimizer's state on every rank.
DDP keeps a full copy of everything on every rank: per parameter, the weight (4 bytes in fp32),
its gradient (4), the bucket that all_reduces it (4) and, with Adam, two moments (8). Here those
bytes are counted on the real objects: 12 with plain SGD, 16 with momentum, 20 with Adam, of
which the optimizer state is the largest share (with mixed precision it is worse: 2 + 2 bytes of
bf16 weights and gradients next to 12 of fp32 master weights and moments). That state is what
makes a model stop fitting long before the compute runs out.

ZeRO stage 1 (the "Zero Redundancy Optimizer" of Rajbhandari et al., 2019) notices that after
the all_reduce every rank holds the same averaged gradients and would take the very same step:
so let each rank step only its own share of the parameters, keeping only that share's state,
and then send its updated parameters to every other rank. Written out, about 40 lines:

1. **partition**, torch's rule: parameters largest first, each to the rank that holds the fewest
   elements so far; a rank's share is whole parameters, never a slice;
2. **local step**: an ordinary ``optimizer_class`` over this rank's share only, so its state
   (the moments) exists for 1/W of the parameters;
3. **send back**: each parameter ``broadcast`` from its owner (what torch does), or each rank's
   share flattened and exchanged in one ``all_gather``.

Each element's update reads only that element's gradient and state, so the sharded step gives
the unsharded optimizer's bits exactly. Proven here, after every step, with SGD with momentum
and with Adam: the hand-written version (both ways of sending back),
``miniddp.optim.ZeroRedundancyOptimizer`` and torch's
``torch.distributed.optim.ZeroRedundancyOptimizer`` (each beside its DDP) all equal to the
unsharded optimizer, bit for bit; each rank's state covers the very parameters torch's gives
it, byte for byte; a control that forgets to send back leaves the ranks apart.

Then the memory, counted exactly (no timing) at 1, 2 and 3 ranks: the optimizer state each rank
holds, next to the prediction total / W, for a model of equal layers and for lesson 00's student,
whose one large weight shows what sharding by whole parameters costs.

Then ZeRO stage 2: the gradients need not be averaged everywhere either. A rank steps only its
share, so it needs only its share's averaged gradients, and the first half of lesson 01's ring
(the reduce-scatter) delivers exactly that: lay the gradients out rank by rank, cut the ring's
chunks at the shares, and after W - 1 exchanges rank r holds the sum of chunk r. Written out
here and equal to all_reduce followed by slicing (bit for bit at 2 ranks; at 3, to lesson 01's
whole ring, and to rounding of gloo's all_reduce, which adds in another order), then trained
with stage 1's all_gather in place of DDP. Communication does not grow: a ring all_reduce *is*
a reduce-scatter and an all-gather; stage 2 reduce-scatters gradients and all-gathers
parameters, the same bytes in total (per rank they differ when the shares do: a share is whole
parameters). Stage 1 as written in section 2, like torch's ``ZeroRedundancyOptimizer``, sends
more: DDP's whole all_reduce, then every parameter from its owner, an all-gather's worth, so
1.5 times DDP's bytes at the least. The stage 2 written here frees the gradients a rank does
not own after the reduce-scatter, but backward has computed all of them by then, so its peak
is DDP's; the saving in the table needs the reduce-scatter during backward, bucket by bucket,
each rank freeing what it does not own once sent. Where this leads: stage 3 shards the
parameters too (torch's FSDP, ``torch.distributed.fsdp.fully_shard``), each layer all-gathered
just before its forward and its backward and freed after; the table at the end shows the bytes
per parameter of each stage.

Run it:

    python lessons/15_sharded_optimizer.py              # 2 ranks (and 1, 2, 3 for the memory)
    python lessons/15_sharded_optimizer.py --nproc 3    # the harder bits: 3 ranks
    torchrun --standalone --nproc_per_node=2 lessons/15_sharded_optimizer.py

What you will see: bytes per parameter for SGD, momentum and Adam, counted; each rank's share
of the parameters, next to torch's; the loss falling under the sharded Adam; "equal bit for bit"
for each optimizer after every step; the control's ranks apart; optimizer state per rank at 1, 2
and 3 ranks next to total / W; the reduce-scatter by hand next to all_reduce and slicing; ZeRO-2
training; the table of the stages; and ``OK: ...``. 10-20 seconds on two CPU cores, most of
them small collectives and processes starting.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader

import miniddp
from miniddp.launch import launch, launched_by_torchrun, rank_device
from miniddp.optim import ZeroRedundancyOptimizer
from miniddp.train.data import make_dataset, make_model, shard
from miniddp.train.report import Progress, check, ok, print0

BATCH_SIZE = 32  # per rank
SAMPLES = 1024  # in all: 16 steps per epoch at 2 ranks
EPOCHS = {"SGD with momentum": 1, "Adam": 2}
OPTIMIZERS = {"SGD with momentum": (torch.optim.SGD, dict(lr=0.2, momentum=0.9)),
              "Adam": (torch.optim.Adam, dict(lr=0.01))}
MEMORY_WORLDS = (1, 2, 3)
TORCHS = "torch's ZeroRedundancyOptimizer"
UNSHARDED = "unsharded optimizer (every rank steps everything)"


# ----- ZeRO stage 1, by hand -----

def partition(params: list[torch.Tensor], world: int) -> list[int]:
    """The rank that owns each parameter, by torch's rule: largest first (equal sizes keep their
    order), each to the rank holding the fewest elements so far (the lowest such rank)."""
    owners, load = [0] * len(params), [0] * world
    for i in sorted(range(len(params)), key=lambda i: params[i].numel(), reverse=True):
        owners[i] = load.index(min(load))
        load[owners[i]] += params[i].numel()
    return owners


class ShardedOptimizer:
    """ZeRO stage 1: each rank steps, and keeps the state of, its own share of the parameters.

    ``send_back`` is how the updated parameters reach the other ranks: "broadcast" (one per
    parameter, from its owner: torch's way), "all_gather" (one call, every share flattened), or
    None: the control, which forgets to.
    """

    def __init__(self, params, optimizer_class, send_back="broadcast", **defaults):
        self.params = list(params)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.owners = partition(self.params, self.world)
        self.shares = [[p for p, owner in zip(self.params, self.owners) if owner == r]
                       for r in range(self.world)]
        self.local = optimizer_class([{"params": self.shares[self.rank]}], **defaults)
        self.send_back = send_back

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.local.step()  # only this rank's share moves, and only its share has state
        if self.send_back == "broadcast":
            for p, owner in zip(self.params, self.owners):
                dist.broadcast(p, src=owner)
        elif self.send_back == "all_gather":
            self.all_gather_shares()

    def all_gather_shares(self) -> None:
        """Every rank's share, flattened and padded to the longest, in one all_gather."""
        sizes = [sum(p.numel() for p in share) for share in self.shares]
        mine = torch.cat([p.reshape(-1) for p in self.shares[self.rank]]
                         + [self.params[0].new_zeros(max(sizes) - sizes[self.rank])])
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        for share, flat, size in zip(self.shares, gathered, sizes):
            for p, part in zip(share, flat[:size].split([p.numel() for p in share])):
                p.copy_(part.view_as(p))


# ----- 1. what every rank holds -----

def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(optimizer) -> int:
    """Every tensor an optimizer keeps from one step to the next, in bytes, counted exactly."""
    return nbytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def one_batch(rank, world, device):
    return (t[rank::world][:BATCH_SIZE].to(device) for t in make_dataset(n=SAMPLES).tensors)


def bytes_per_parameter(rank, world, device):
    """One DDP step with each optimizer; the bytes of each thing every rank holds, counted."""
    x, y = one_batch(rank, world, device)
    print0("1. What every rank holds under DDP, counted on the objects (bytes per parameter):")
    print0(f"  {'optimizer':<18} {'weights':>8} {'gradients':>10} {'bucket':>7} {'state':>7} "
           f"{'total':>7}")
    for name, (cls, defaults) in [("SGD", (torch.optim.SGD, dict(lr=0.1))), *OPTIMIZERS.items()]:
        ddp = miniddp.DistributedDataParallel(make_model(seed=0).to(device))
        params = list(ddp.parameters())
        optimizer = cls(params, **defaults)
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()
        numel = sum(p.numel() for p in params)
        held = [nbytes(params), nbytes(p.grad for p in params),
                sum(b.nbytes for b in ddp.buckets), state_bytes(optimizer)]
        print0(f"  {name:<18} " + " ".join(f"{b / numel:{width}.2f}" for b, width in
                                            zip(held + [sum(held)], (8, 10, 7, 7, 7))))
        moments = {"SGD": 0, "SGD with momentum": 1, "Adam": 2}[name]
        steps = len(params) if name == "Adam" else 0  # Adam counts its steps: a float each
        check(held == [4 * numel] * 3 + [4 * moments * numel + 4 * steps],
              f"{name}: counted {held} bytes, expected 4 per element for the weights, the "
              f"gradients and the bucket, and {moments} fp32 moments per element")
    print0("  (Adam's state also holds a step count per parameter tensor: the .01.) Stage 1 "
           "keeps the weights,\n  gradients and bucket, and 1/W of the state: with Adam "
           f"12 + 8/W bytes per parameter, {12 + 8 / world:.2f} at {world} ranks.")


# ----- 2. the sharded step, against the library, torch, and the unsharded optimizer -----

def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def everyone(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def positions(params, chosen) -> list[int]:
    """Where each of ``chosen`` sits in ``params`` (model order)."""
    ids = {id(p) for p in chosen}
    return [i for i, p in enumerate(params) if id(p) in ids]


def train_side_by_side(rank, world, device, name, verbose):
    """Five runs on the same batches; after every step each sharded one is compared with the
    unsharded optimizer, the oracle: every rank stepping every parameter."""
    cls, defaults = OPTIMIZERS[name]
    models = [miniddp.DistributedDataParallel(make_model(seed=0).to(device)) for _ in range(4)]
    models.append(TorchDDP(make_model(seed=0).to(device)))
    runs = {UNSHARDED: cls(models[0].parameters(), **defaults),
            "by hand, broadcast": ShardedOptimizer(models[1].parameters(), cls, **defaults),
            "by hand, all_gather": ShardedOptimizer(models[2].parameters(), cls, "all_gather",
                                                    **defaults),
            "miniddp's ZeroRedundancyOptimizer": ZeroRedundancyOptimizer(
                models[3].parameters(), cls, **defaults),
            TORCHS: TorchZeRO(models[4].parameters(), cls, **defaults)}
    loader = DataLoader(shard(make_dataset(n=SAMPLES, seed=0), rank, world),
                        batch_size=BATCH_SIZE, drop_last=True)
    steps = EPOCHS[name] * len(loader)
    progress = Progress(steps, every=max(1, steps // 4), quiet=not verbose)
    first_difference, step = dict.fromkeys(list(runs)[1:]), 0
    for _epoch in range(EPOCHS[name]):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            for model, optimizer in zip(models, runs.values()):
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                if model is models[1]:
                    progress(loss)
            oracle = flat(models[0])
            for label, model in zip(first_difference, models[1:]):
                if first_difference[label] is None and not torch.equal(flat(model), oracle):
                    first_difference[label] = step
            step += 1
    return models, runs, first_difference, progress.losses()


def sharded_step(rank, world, device, name, verbose):
    models, runs, first_difference, losses = train_side_by_side(rank, world, device, name,
                                                                verbose)
    params = list(models[1].parameters())
    mine = positions(params, runs["by hand, broadcast"].shares[rank])
    theirs = positions(list(models[4].parameters()), runs[TORCHS].optim.param_groups[0]["params"])
    local = {"by hand, broadcast": runs["by hand, broadcast"].local,
             "by hand, all_gather": runs["by hand, all_gather"].local,
             "miniddp's ZeroRedundancyOptimizer": runs["miniddp's ZeroRedundancyOptimizer"].optim,
             TORCHS: runs[TORCHS].optim}
    counted = {label: state_bytes(optimizer) for label, optimizer in local.items()}
    shares, states = everyone(mine), everyone(counted)
    print0(f"\n  {name}: the parameters (positions in {[tuple(p.shape) for p in params]}) and "
           "optimizer state of each rank:")
    for r in range(world):
        print0(f"    rank {r}: {shares[r]}, {states[r]['by hand, broadcast']} bytes of state by "
               f"hand; {TORCHS}: {states[r][TORCHS]}")
    check(mine == theirs, f"rank {rank} owns the parameters {mine} by hand; {TORCHS} gives it "
                          f"{theirs}")
    check(sorted(i for share in shares for i in share) == list(range(len(params))),
          f"the shares {shares} do not hold every parameter exactly once")
    for label, held in counted.items():
        check(held == counted[TORCHS], f"rank {rank}: {label} keeps {held} bytes of state, "
                                       f"{TORCHS} {counted[TORCHS]}")
    print0(f"    equal to the {UNSHARDED} bit for bit after every step:")
    for label, difference in first_difference.items():
        print0(f"      {label:<34} {difference is None}")
        check(difference is None, f"rank {rank}: {name}, {label} differs from the unsharded "
                                  f"optimizer after step {difference}")
    return losses


def forgetting_to_send_back(rank, world, device):
    """The control: the local step alone. The owner's replica moves, the others' do not."""
    model = miniddp.DistributedDataParallel(make_model(seed=0).to(device))
    sharded = ShardedOptimizer(model.parameters(), torch.optim.Adam, send_back=None, lr=0.01)
    x, y = one_batch(rank, world, device)
    F.mse_loss(model(x), y).backward()
    sharded.step()
    replicas = everyone(flat(model).cpu())
    apart = sum(not torch.equal(replicas[0], other) for other in replicas[1:])
    print0(f"\n  control, the local step without sending back: after one step {apart} of "
           f"{world - 1} other ranks hold another model than rank 0")
    check(apart == world - 1, "without sending the updated parameters back, every rank should "
                              "hold another model after one step")


# ----- 3. memory per rank at 1, 2, 3 ranks -----

def equal_layers() -> nn.Module:
    """Twelve equal layers: their parameters split evenly over 1, 2, 3, 4 or 6 ranks."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])


def memory_per_rank() -> list[dict]:
    """Every rank's optimizer state after one Adam step, in bytes: by hand, torch's, unsharded;
    and the model's element count. One dict per rank, on every rank."""
    device = rank_device()
    rows = {}
    for name, build in (("twelve equal layers", equal_layers),
                        ("lesson 00's student", lambda: make_model(seed=0))):
        models = [build().to(device) for _ in range(3)]
        x = torch.randn(8, models[0][0].in_features, generator=torch.Generator().manual_seed(0))
        optimizers = [ShardedOptimizer(models[0].parameters(), torch.optim.Adam, lr=0.01),
                      TorchZeRO(models[1].parameters(), torch.optim.Adam, lr=0.01),
                      torch.optim.Adam(models[2].parameters(), lr=0.01)]
        for model, optimizer in zip(models, optimizers):
            model(x.to(device)).square().mean().backward()
            optimizer.step()
        rows[name] = (state_bytes(optimizers[0].local), state_bytes(optimizers[1].optim),
                      state_bytes(optimizers[2]), sum(p.numel() for p in models[0].parameters()))
    return everyone(rows)


def show_memory(by_world: dict) -> None:
    print0("\n3. Adam's state on each rank after one step, in bytes, counted (not timed):")
    for name in ("twelve equal layers", "lesson 00's student"):
        total = by_world[min(by_world)][0][name][2]
        print0(f"  {name}: unsharded, every rank holds {total}")
        for world, ranks in sorted(by_world.items()):
            mine, torchs = [r[name][0] for r in ranks], [r[name][1] for r in ranks]
            print0(f"    {world} rank{'s' if world > 1 else ' '}: by hand {mine}, torch's "
                   f"{torchs}; total / W = {total / world:.0f}; the largest share is "
                   f"{max(mine) / total:.0%} of the total")
            check(mine == torchs, f"{name} at {world} ranks: the state held by hand differs "
                                  f"from {TORCHS}'s, rank by rank")
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


# ----- 4. ZeRO stage 2: reduce-scatter the gradients -----

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
    shows what a rank needs to keep, not yet the memory saved (see section 5)."""
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
    x, y = one_batch(rank, world, device)
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
           f"{sum(every)} in all,\n  (W-1) x {total}. The all_gather of the parameters sends "
           "as many again: together a ring\n  all_reduce's traffic, DDP's, in total (2(W-1)/W "
           "of the elements per rank on average; per rank\n  not, when the shares differ in "
           "size). ZeRO-1 as in section 2 sends more: DDP's whole\n  all_reduce, then every "
           "parameter from its owner (each rank receives every parameter it does\n  not own, an "
           "all-gather's worth): in total 1.5x DDP's bytes at the least.")


def stage_two(rank, world, device):
    print0("\n4. ZeRO stage 2: a rank needs the averaged gradients of its own share only")
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
        worst = max(worst, (flat(models[0]) - flat(models[1])).abs().max().item())
    share = sum(p.numel() for p in optimizers[0].shares[rank])
    check(kept == {share}, f"rank {rank} kept {sorted(kept)} gradient elements after its "
                           f"steps, expected its share's {share}")
    print0(f"  after each step rank 0 keeps the gradients of its share only ({share} of "
           f"{flat(models[0]).numel()} elements);\n  backward still computed all of them "
           "first, so its peak is DDP's (section 5 says what stage 2 takes)")
    print0(f"  ZeRO-2, no DDP: {len(losses)} steps, rank 0's loss {losses[0]:.4f} -> "
           f"{losses[-1]:.4f}; largest difference from torch's DDP + ZeroRedundancyOptimizer "
           f"{worst:.1e}" + (" (bit for bit: at 2 ranks a + b is b + a)" if world == 2 else
                             " (the ring's order of summation)"))
    check(losses[-1] < 0.2 * losses[0], f"ZeRO-2's loss went from {losses[0]:.4f} to "
                                        f"{losses[-1]:.4f}, not below 20% of it")
    check(worst == 0.0 if world == 2 else worst < 1e-5,
          f"rank {rank}: ZeRO-2 ended {worst:.1e} from torch's DDP + ZeroRedundancyOptimizer")


# ----- 5. where this leads -----

def stages_table(measured: dict) -> None:
    print0("\n5. Bytes per parameter on each rank, fp32 Adam, and where the stages lead (DDP's "
           "bucket is kept\n   from step to step; stage 2's reduce-scatter buffer and stage 3's "
           "gathered layer are\n   transient, left out):")
    worlds = (1, 2, 3, 8, 64)
    stages = [("DDP", lambda w: 20), ("ZeRO-1 (this lesson)", lambda w: 12 + 8 / w),
              ("ZeRO-2 (gradients too)", lambda w: 4 + 12 / w),
              ("ZeRO-3, FSDP (weights too)", lambda w: 16 / w)]
    print0(f"  {'':<27}" + "".join(f"{f'W={w}':>8}" for w in worlds))
    for name, per_parameter in stages:
        print0(f"  {name:<27}" + "".join(f"{per_parameter(w):8.2f}" for w in worlds))
    print0("  (ZeRO-2's row is not what section 4's code holds at its peak: there backward "
           "computes every\n  gradient before the reduce-scatter. The row needs the "
           "reduce-scatter during backward, bucket\n  by bucket as DDP's all_reduce is, each "
           "rank freeing the gradients it does not own once sent.)")
    print0("  measured, ZeRO-1 on twelve equal layers: " + ", ".join(
        f"W={w}: {12 + value:.2f}" for w, value in sorted(measured.items())) +
        " (section 1's 12, and section 3's largest state per element)")


def on_every_rank(memory: dict):
    """Sections 1 to 5; ``memory`` holds the state per rank measured at other world sizes."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    print0(f"{world} ranks on {device}\n")
    bytes_per_parameter(rank, world, device)
    print0("\n2. ZeRO-1 by hand, beside miniddp's and torch's ZeroRedundancyOptimizer and the "
           "unsharded optimizer:")
    losses = None
    for name in OPTIMIZERS:
        losses = sharded_step(rank, world, device, name, verbose=name == "Adam")
    check(losses[-1] < 0.2 * losses[0], f"the sharded Adam's loss went from {losses[0]:.4f} to "
                                        f"{losses[-1]:.4f}, not below 20% of it")
    forgetting_to_send_back(rank, world, device)
    memory = {**memory, world: memory_per_rank()}
    show_memory(memory)
    if launched_by_torchrun():
        print0(f"  (under torchrun, only this job's {world} ranks: run it plainly for "
               f"{', '.join(map(str, MEMORY_WORLDS))})")
    stage_two(rank, world, device)
    stages_table({w: max(r["twelve equal layers"][0] for r in ranks) /
                  ranks[0]["twelve equal layers"][3] for w, ranks in memory.items()})
    return {"world": world, "losses": (losses[0], losses[-1]), "memory": sorted(memory)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    memory = {} if launched_by_torchrun() else {  # measured first, shown in section 3
        world: launch(memory_per_rank, world)[0] for world in MEMORY_WORLDS if world != args.nproc}
    result = launch(on_every_rank, args.nproc, args=(memory,))[0]
    first, last = result["losses"]
    ok(f"on {result['world']} ranks the optimizer state sharded by hand equals miniddp's and "
       f"torch's ZeroRedundancyOptimizer and the unsharded optimizer bit for bit (loss "
       f"{first:.3f} -> {last:.4f}); each rank held 1/W of the state at "
       f"{', '.join(map(str, result['memory']))} ranks; the reduce-scatter gave each rank its "
       "share of the averaged gradients")


if __name__ == "__main__":
    main()
