"""Lesson 15: after DDP, shard the optimizer: ZeRO stage 1 by hand, bit for bit torch's.

What this adds since lesson 14: a way to stop repeating the optimizer's state on every rank.
Under DDP every rank holds, per parameter, the weight (4 bytes in fp32), its gradient (4), the
bucket that all_reduces it (4) and the optimizer's state: 0 for SGD, 4 with momentum, 8 for
Adam's two moments. That state is the largest share, and what stops a model from fitting first.

ZeRO stage 1 (Rajbhandari et al., 2019): after the all_reduce every rank holds the same averaged
gradients and would take the very same step, so each rank steps only its own share of the
parameters, keeping only that share's state, and sends its updated parameters to the others.
Written out here in about 40 lines (``partition``, ``ShardedOptimizer``):

1. **partition**, torch's rule: parameters largest first (equal sizes keep their order), each to
   the rank that holds the fewest elements so far; a share is whole parameters;
2. **local step**: an ordinary optimizer over this rank's share only, so the moments exist for
   1/W of the parameters, and a new learning rate is set where that optimizer reads it;
3. **send back**: each parameter ``broadcast`` from its owner (torch's way), or every share
   flattened into one ``all_gather``.

Why it is exact: an element's update reads only that element's gradient and state, so the
sharded step gives the unsharded optimizer's bits. Proven after every step, with SGD with
momentum and with Adam, for the version by hand (both ways of sending back),
``miniddp.optim.ZeroRedundancyOptimizer`` and torch's ``ZeroRedundancyOptimizer``; each rank's
share is torch's, also for twelve equal layers where every size ties, and a learning rate
halved mid-run (a scheduler's) reaches every share. A control that forgets to send back leaves
the ranks apart. Lesson 15, part 2 (``15_sharded_optimizer_stage_2.py``) counts the memory and
shards the gradients too (ZeRO-2).

Run it:

    python lessons/15_sharded_optimizer.py              # 2 ranks, gloo on CPU
    python lessons/15_sharded_optimizer.py --nproc 3    # the harder bits: 3 ranks
    torchrun --standalone --nproc_per_node=2 lessons/15_sharded_optimizer.py

What you should see: bytes per parameter for SGD, momentum and Adam, counted; for each optimizer
the loss falling, each rank's share next to torch's, and every sharded run equal to the
unsharded one bit for bit; the equal layers' owners, torch's, through the schedule; the control
apart; ``OK: ...``. About 20 s.
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
from course.data import make_dataset, make_model, shard
from course.report import Progress, check, ok, print0
from miniddp.launch import launch, rank_device
from miniddp.optim import ZeroRedundancyOptimizer

BATCH_SIZE = 32  # per rank
SAMPLES = 1024  # in all: 16 steps per epoch at 2 ranks
EPOCHS = {"SGD with momentum": 1, "Adam": 2}
OPTIMIZERS = {"SGD with momentum": (torch.optim.SGD, dict(lr=0.2, momentum=0.9)),
              "Adam": (torch.optim.Adam, dict(lr=0.01))}
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

    @property
    def param_groups(self) -> list[dict]:
        """Where a scheduler sets the learning rate: the local optimizer, which reads it."""
        return self.local.param_groups

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


def train_side_by_side(rank, world, device, name):
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
    progress = Progress(steps, every=max(1, steps // 4))
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


def sharded_step(rank, world, device, name):
    print0(f"\n  {name}, the loss under the sharded step by hand:")
    models, runs, first_difference, losses = train_side_by_side(rank, world, device, name)
    params = list(models[1].parameters())
    mine = positions(params, runs["by hand, broadcast"].shares[rank])
    theirs = positions(list(models[4].parameters()), runs[TORCHS].optim.param_groups[0]["params"])
    local = {"by hand, broadcast": runs["by hand, broadcast"].local,
             "by hand, all_gather": runs["by hand, all_gather"].local,
             "miniddp's ZeroRedundancyOptimizer": runs["miniddp's ZeroRedundancyOptimizer"].optim,
             TORCHS: runs[TORCHS].optim}
    counted = {label: state_bytes(optimizer) for label, optimizer in local.items()}
    shares, states = everyone(mine), everyone(counted)
    print0(f"  the parameters (positions in {[tuple(p.shape) for p in params]}) and "
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


# ----- 3. equal sizes and a changing learning rate -----

def equal_layers() -> nn.Module:
    """Twelve equal layers: every weight ties with every other, and every bias too."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])


def equal_sizes_and_a_schedule(rank, world, device):
    """The owners of equal-size parameters are torch's (ties keep model order), and a learning
    rate set on ``param_groups`` mid-run, as a scheduler sets it, reaches every share."""
    models = [miniddp.DistributedDataParallel(equal_layers().to(device)) for _ in range(3)]
    models.append(TorchDDP(equal_layers().to(device)))
    runs = {UNSHARDED: torch.optim.Adam(models[0].parameters(), lr=0.01),
            "by hand": ShardedOptimizer(models[1].parameters(), torch.optim.Adam, lr=0.01),
            "miniddp's ZeroRedundancyOptimizer": ZeroRedundancyOptimizer(
                models[2].parameters(), torch.optim.Adam, lr=0.01),
            TORCHS: TorchZeRO(models[3].parameters(), torch.optim.Adam, lr=0.01)}
    print0("\n3. Twelve equal layers (every weight the same size, every bias too), Adam's "
           "learning rate halved every 3 steps:")
    first_difference = dict.fromkeys(list(runs)[1:])
    generator = torch.Generator().manual_seed(rank)
    for step in range(9):
        x = torch.randn(BATCH_SIZE, 64, generator=generator).to(device)
        for model, optimizer in zip(models, runs.values()):
            for group in optimizer.param_groups:  # what a scheduler does
                group["lr"] = 0.01 * 0.5 ** (step // 3)
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        for label, model in zip(first_difference, models[1:]):
            if first_difference[label] is None and not torch.equal(flat(model), flat(models[0])):
                first_difference[label] = step
    params = list(models[0].parameters())
    local = [runs["by hand"].local] + [runs[label].optim for label in list(runs)[2:]]
    owned = {label: positions(list(model.parameters()), optimizer.param_groups[0]["params"])
             for label, model, optimizer in zip(first_difference, models[1:], local)}
    for r, share in enumerate(everyone(owned[TORCHS])):
        print0(f"  rank {r} owns the parameters {share} (torch's)")
    for label, share in owned.items():
        check(share == owned[TORCHS], f"rank {rank}: with equal sizes, {label} gives this rank "
                                      f"the parameters {share}, {TORCHS} {owned[TORCHS]}")
    for label, difference in first_difference.items():
        check(difference is None, f"rank {rank}: with the learning rate changed every 3 steps, "
                                  f"{label} differs from the unsharded optimizer after step "
                                  f"{difference}")
    print0(f"  the same owners by hand, in miniddp's and in torch's; all {len(params)} "
           f"parameters equal to the\n  {UNSHARDED} bit for bit after each of the 9 steps, at "
           "learning rates 0.01, 0.005 and 0.0025")


def on_every_rank():
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    print0(f"{world} ranks on {device}\n")
    bytes_per_parameter(rank, world, device)
    print0("\n2. ZeRO-1 by hand, beside miniddp's and torch's ZeroRedundancyOptimizer and the "
           "unsharded optimizer:")
    losses = None
    for name in OPTIMIZERS:
        losses = sharded_step(rank, world, device, name)
    check(losses[-1] < 0.2 * losses[0], f"the sharded Adam's loss went from {losses[0]:.4f} to "
                                        f"{losses[-1]:.4f}, not below 20% of it")
    forgetting_to_send_back(rank, world, device)
    equal_sizes_and_a_schedule(rank, world, device)
    return world, losses[0], losses[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world, first, last = launch(on_every_rank, args.nproc)[0]
    ok(f"on {world} ranks the optimizer state sharded by hand equals miniddp's and torch's "
       f"ZeroRedundancyOptimizer and the unsharded optimizer bit for bit (Adam's loss "
       f"{first:.3f} -> {last:.4f}), with torch's owners for equal sizes and a learning rate "
       "changed mid-run")


if __name__ == "__main__":
    main()
