"""Lesson 04: the sampler, which decides which samples each rank reads.

What this adds since lesson 03: there, every rank cut its slice out of each global batch by
hand. Real training reads data through a ``DataLoader``, and the piece that tells each rank's
loader which samples to read is a ``DistributedSampler`` (here ``miniddp.DistributedSampler``,
which gives the same indices as torch's and can also resume mid-epoch). It lays an epoch out as
one list of indices and deals it out like cards: rank ``r`` of ``R`` takes positions
``r, r + R, r + 2R, ...``. Every rank builds the same list from the same seed, so no message is
needed to agree on who reads what.

Why it matters: the data is the only thing that differs between ranks. Get it wrong and nothing
crashes; the ranks just waste their work:

* a plain ``DataLoader(dataset, shuffle=True)`` on every rank, with the same seed everywhere (as
  almost every script sets one), hands every rank the *same* batches: R ranks do one rank's work;
* forgetting ``sampler.set_epoch(epoch)`` replays the first epoch's order every epoch.

(With a sampler, leave the DataLoader's ``shuffle`` off: the sampler shuffles, and the
DataLoader refuses both at once.)

This lesson shows each behaviour and checks it: disjoint, equal shares (padded with repeats, or
cut with ``drop_last``, because a rank with one batch more would wait forever in a collective),
a new order each epoch, both failures above, the same indices as
``torch.utils.data.distributed.DistributedSampler`` index for index, and a job resumed in the
middle of an epoch from ``state_dict()``. Then it trains with ``miniddp.DistributedDataParallel``
(lesson 03's averaging, packaged; lessons 05-06 open it up) and a sampler: step k's global batch
is the k-th slice of the epoch's permutation, so the oracle is one process reading the same
permutation with a batch R times larger.

Run it:

    python lessons/04_the_sampler.py              # forks 2 ranks, gloo on CPU
    python lessons/04_the_sampler.py --nproc 3    # 3 ranks: padding shows
    torchrun --standalone --nproc_per_node=2 lessons/04_the_sampler.py

With one GPU per rank (``--nproc N`` on an N-GPU machine) it trains with NCCL on the GPUs.

What you will see: each rank's indices for a small dataset (with the padding and ``drop_last``),
the first indices of three epochs with and without ``set_epoch``, the share of distinct samples
with and without the sampler, a resumed epoch, the loss falling, and ``OK: ...``. About 15 s.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from course.data import make_dataset, make_model
from course.report import Progress, check, ok, print0
from miniddp import DistributedDataParallel, DistributedSampler
from miniddp.launch import launch, rank_device

EPOCHS = 4
LOCAL_BATCH = 32
LR = 0.2


def everyone(obj) -> list:
    """Every rank's ``obj``, in rank order (a collective)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def shares():
    """Who reads what: disjoint equal shares, padded or cut when R does not divide n."""
    world = dist.get_world_size()
    n = 4 * world + 1  # never a multiple of the world size (beyond 1 rank)
    print0(f"\n1. a dataset of {n} samples over {world} ranks, no shuffling")
    for drop_last in (False, True):
        sampler = DistributedSampler(range(n), shuffle=False, drop_last=drop_last)
        lists = everyone(list(sampler))
        for rank, indices in enumerate(lists):
            print0(f"   drop_last={drop_last!s:<5} rank {rank}: {indices}")
        read = [i for indices in lists for i in indices]
        check(len({len(indices) for indices in lists}) == 1,
              f"ranks got shares of different lengths: {[len(x) for x in lists]}")
        if drop_last:
            check(len(set(read)) == len(read) == n - n % world,
                  f"drop_last must give disjoint shares covering {n - n % world} samples")
        else:
            check(set(read) == set(range(n)) and len(read) - n == (-n) % world,
                  f"without drop_last every sample is read, and {(-n) % world} padded repeats")
    print0(f"   without drop_last the list is padded to {world * -(-n // world)} with indices "
           f"from its start; with drop_last it is cut to {world * (n // world)}")


def epochs_and_order():
    """``set_epoch`` reshuffles; without it every epoch replays the first one's order."""
    print0("\n2. shuffle=True: rank 0's first indices in epochs 0, 1 and 2")
    n = 1000
    with_set_epoch, without = DistributedSampler(range(n)), DistributedSampler(range(n))
    firsts = {"with set_epoch": [], "without": []}
    for epoch in range(3):
        with_set_epoch.set_epoch(epoch)
        firsts["with set_epoch"].append(list(with_set_epoch))
        firsts["without"].append(list(without))  # the usual bug: set_epoch is never called
    for label, lists in firsts.items():
        print0(f"   {label:<15} " + " | ".join(str(x[:5])[1:-1] for x in lists))
    check(len({tuple(x) for x in firsts["with set_epoch"]}) == 3,
          "with set_epoch, three epochs must give three different orders")
    check(len({tuple(x) for x in firsts["without"]}) == 1,
          "without set_epoch every epoch should repeat the first one's order")


def without_a_sampler():
    """A shuffling DataLoader on every rank, seeded alike: every rank reads the same batches."""
    world = dist.get_world_size()
    n = 500 * world  # a multiple of the world size: no padding to blur the count
    print0(f"\n3. one epoch of {n} samples, batches of 50: distinct samples the {world} ranks "
           "read together")
    torch.manual_seed(0)  # what most scripts do, on every rank alike
    plain = [b.tolist() for b in DataLoader(range(n), batch_size=50, shuffle=True)]
    sampled = [b.tolist() for b in DataLoader(range(n), batch_size=50,
                                              sampler=DistributedSampler(range(n)))]
    for label, batches in (("DataLoader(shuffle=True)", plain), ("DistributedSampler", sampled)):
        read = [i for lists in everyone(batches) for b in lists for i in b]
        print0(f"   {label:<24} {len(read):>5} samples read, {len(set(read)):>4} distinct, "
               f"{len(batches)} steps per epoch")
        if label == "DistributedSampler":
            check(len(set(read)) == len(read) == n, "the sampler's shares must be disjoint")
        else:
            check(all(x == plain for x in everyone(plain)),
                  "with one seed everywhere, every rank should read the same batches")
    print0(f"   without the sampler every rank read every batch: {world} ranks did one rank's "
           f"work, and an epoch took {world}x as many steps")


def same_as_torch():
    """Index for index equal to torch's sampler, across sizes, flags, seeds and epochs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cases = 0
    for n in (1, 2, 7, 10, 11, 100, 2048):
        for shuffle in (False, True):
            for drop_last in (False, True):
                for seed, epoch in ((0, 0), (0, 3), (42, 1)):
                    ours = DistributedSampler(range(n), world, rank, shuffle, seed, drop_last)
                    theirs = TorchSampler(range(n), world, rank, shuffle, seed, drop_last)
                    ours.set_epoch(epoch)
                    theirs.set_epoch(epoch)
                    check(list(ours) == list(theirs) and len(ours) == len(theirs),
                          f"n={n} shuffle={shuffle} drop_last={drop_last} seed={seed} "
                          f"epoch={epoch}, rank {rank}: {list(ours)[:8]}... differs from "
                          f"torch's {list(theirs)[:8]}...")
                    cases += 1
    print0(f"\n4. the same indices as torch's DistributedSampler in all {cases} cases tried "
           "(sizes, shuffle, drop_last, seeds, epochs) on every rank")


def resume_mid_epoch():
    """Stop after a few batches, save the sampler's state, resume in a fresh sampler."""
    n, epoch, batch = 40 * dist.get_world_size(), 1, 4
    print0(f"\n5. resuming in the middle of epoch {epoch} (rank 0's batches)")
    sampler = DistributedSampler(range(n), seed=7)
    sampler.set_epoch(epoch)
    before, seen = [], 0
    for b in DataLoader(range(n), batch_size=batch, sampler=sampler):
        before.append(b.tolist())
        seen += len(b)
        if len(before) == 3:
            break  # the job is killed here ...
    state = sampler.state_dict(trained=seen)  # ... after saving this with its checkpoint

    fresh = DistributedSampler(range(n), seed=7)  # a new process
    fresh.load_state_dict(state)
    fresh.set_epoch(epoch)  # the loop's usual call keeps the loaded position
    after = [b.tolist() for b in DataLoader(range(n), batch_size=batch, sampler=fresh)]
    whole = DistributedSampler(range(n), seed=7)
    whole.set_epoch(epoch)
    print0(f"   before the crash: {before}\n   after the resume: {after[:2]} ... "
           f"({len(after)} batches)\n   state saved: {state}")
    resumed = [i for b in before + after for i in b]
    check(resumed == list(whole), "the resumed epoch is not the uninterrupted epoch")
    restarted = TorchSampler(range(n), seed=7)
    restarted.set_epoch(epoch)
    print0(f"   torch's sampler has no position: restarted, it begins again at "
           f"{list(restarted)[:batch]} and rereads {seen} samples")


def resume_at_another_world_size():
    """A state saved by W ranks, loaded by another number with ``reshard=True``: the positions
    no rank had reached are dealt over the new ranks. Every rank is simulated here, in one
    process, so the whole epoch can be checked: each sample read exactly once."""
    n, epoch, used = 60, 1, 4  # 60: divisible by 2, 3 and 4, so no padding blurs the count
    print0("\n6. resuming at another world size (every rank simulated in this process)")
    for saved_by, resumed_by in ((3, 2), (2, 4)):
        read = []
        for rank in range(saved_by):
            sampler = DistributedSampler(range(n), saved_by, rank, seed=7)
            sampler.set_epoch(epoch)
            indices = iter(sampler)
            read += [next(indices) for _ in range(used)]
            state = sampler.state_dict()  # every rank has used `used` samples: the same state
        for rank in range(resumed_by):
            sampler = DistributedSampler(range(n), resumed_by, rank, seed=7)
            sampler.load_state_dict(state, reshard=True)
            sampler.set_epoch(epoch)
            read += list(sampler)
        print0(f"   {saved_by} ranks read {used} each, {resumed_by} ranks read the rest: "
               f"{len(read)} samples, {len(set(read))} distinct")
        check(sorted(read) == list(range(n)), f"saved by {saved_by} ranks after {used} samples "
              f"each and resumed by {resumed_by}, the epoch read {len(read)} samples, "
              f"{len(set(read))} distinct: expected each of the {n} exactly once (the resume "
              f"must skip the {used * saved_by} samples already read)")


def train(device):
    """DDP with a sampler and set_epoch; the oracle is one process on the same permutations."""
    rank, world = dist.get_rank(), dist.get_world_size()
    print0(f"\n7. training: {world} ranks x {LOCAL_BATCH} samples per step, reshuffled each epoch")
    data = make_dataset(n=2048, seed=0)
    seed = 0
    sampler = DistributedSampler(data, seed=seed)
    loader = DataLoader(data, batch_size=LOCAL_BATCH, sampler=sampler, drop_last=True)
    ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(make_model(seed=0).to(device), device_ids=ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    progress = Progress(EPOCHS * len(loader))
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            progress(loss)

    oracle = make_model(seed=0).to(device)  # one process, batch LOCAL_BATCH * world
    optimizer = torch.optim.SGD(oracle.parameters(), lr=LR, momentum=0.9)
    global_batch = LOCAL_BATCH * world
    for epoch in range(EPOCHS):
        # The sampler's rule: each epoch's permutation comes from a generator seeded with
        # seed + epoch (set_epoch changes the epoch, the seed stays), the same on every rank
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch))
        for k in range(len(loader)):  # step k reads the k-th slice of the permutation
            x, y = data[order[k * global_batch:(k + 1) * global_batch]]
            loss = F.mse_loss(oracle(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    diff = max((p - q).abs().max().item()
               for p, q in zip(model.module.parameters(), oracle.parameters()))
    losses = progress.losses()
    print0(f"   largest difference from one process reading the same permutations: {diff:.1e}")
    check(losses[-1] < 0.1 * losses[0],
          f"the loss went from {losses[0]:.4f} to {losses[-1]:.4f}: not below 10% of its start")
    check(diff < 1e-4, f"rank {rank}: DDP with the sampler and the one-process oracle differ by "
                       f"{diff:.2e}")
    return diff


def on_every_rank():
    device = rank_device()
    shares()
    epochs_and_order()
    without_a_sampler()
    same_as_torch()
    resume_mid_epoch()
    resume_at_another_world_size()
    return dist.get_world_size(), train(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world, diff = launch(on_every_rank, args.nproc)[0]
    ok(f"DistributedSampler gave each of {world} rank(s) a disjoint, equal share, reshuffled "
       f"each epoch, equal to torch's index for index, resumed mid-epoch, and trained like one "
       f"process (max difference {diff:.1e})")


if __name__ == "__main__":
    main()
