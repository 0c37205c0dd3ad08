"""Lesson 14: uneven inputs, the hang they cause and ``ddp.join()``, which prevents it.

What this adds: ranks that do not have the same number of batches (lesson 08's DDP and lesson
03's loop, fed uneven data). Until now every rank had an equal shard (``course.data.shard``
drops the remainder on purpose, and ``DistributedSampler`` pads). Real data is often uneven:
files of different lengths per rank, samples filtered on the fly, variable-length sequences
packed into batches. Every synchronized backward is a set of collectives that *every* rank must
call; a rank that runs out of data leaves its loop, and the others wait in their next all_reduce
for a partner that never comes. With the default timeouts (30 minutes on gloo, 10 on NCCL) that
looks like a job that silently stopped.

First the hang, shown safely: rank 0 gets one batch fewer, in a process group whose timeout is
3 seconds. The other ranks' all_reduce fails after those 3 seconds; the error is caught and
explained. Then the fix, written out small: each step, every rank all_reduces "I still have
data"; a rank without data takes part anyway, contributing zero gradients, until the count is 0;
then the last rank to finish broadcasts its model. That is all ``join`` does
(``miniddp/options/join.py`` says which collectives it mirrors). Last, the real thing:
``with ddp.join():`` around the same uneven loop, miniddp's DDP and torch's side by side,
bit-identical after every step, and every rank holding the same model at the end.

The one choice ``join`` leaves you: ``divide_by_initial_world_size=True`` (the default) keeps
dividing the summed gradients by the world size, so every sample weighs the same and a step
with fewer ranks takes a smaller step; ``False`` divides by the ranks still training, as if the
job had shrunk. Both are checked here against torch's DDP.

Run it:

    python lessons/14_uneven_inputs.py                 # 2 ranks, gloo on CPU
    python lessons/14_uneven_inputs.py --nproc 3
    torchrun --standalone --nproc_per_node=2 lessons/14_uneven_inputs.py

What you will see: the hang: which ranks waited, in which collective, the error they got after
3 s and what it means; the batches each rank has, and why only their total over the epochs
matters; join by hand, close to the real one; the loss falling on every
rank while the ranks that ran out shadow the others; miniddp equal to torch's DDP bit for bit
after every step, for both divisors; the same model on every rank at the end, equal to torch's
bit for bit; and ``OK: ...``. About 25 s, 3 of them waiting for the timeout. Gloo on the CPU
even where there are GPUs: the hang is shown with gloo's timeout.
"""

import argparse
import re
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, Subset

import miniddp
from course.data import make_dataset, make_model, shard
from course.report import check, ok, print0
from miniddp.launch import launch

BATCH_SIZE = 32
FEWER_PER_RANK = 3  # batches per epoch that each rank has fewer than the next one
EPOCHS = 3
LR = 0.2
HANG_TIMEOUT = 3.0  # seconds: the demo's process group gives up this fast
BY_HAND_TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # see the comparison in on_every_rank


def uneven_loader(rank: int, world: int) -> DataLoader:
    """This rank's equal shard, minus ``FEWER_PER_RANK`` batches for each rank above it:
    rank 0 has the fewest batches and runs out first, the last rank has them all."""
    mine = shard(make_dataset(n=2048, seed=0), rank, world)
    fewer = (world - 1 - rank) * FEWER_PER_RANK * BATCH_SIZE
    return DataLoader(Subset(mine, range(len(mine) - fewer)), batch_size=BATCH_SIZE)


def step(model, optimizer, x, y) -> torch.Tensor:
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


# ----- 1. the hang -----

def collective_of(error: Exception) -> str:
    """Which of DDP's collectives raised ``error``, read from the functions it passed through:
    the bucket rebuild's broadcast runs at the start of the second forward
    (``miniddp.buckets.rebuilt_assignment``), the gradients' all_reduce in backward."""
    functions = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    if "rebuilt_assignment" in functions:
        return "the bucket rebuild's broadcast, at the start of its second forward"
    if "backward" in functions:
        return "the gradient all_reduce, in its second backward"
    return f"a collective under {functions[-1]}"

def the_hang(rank: int, world: int) -> str | None:
    """Rank 0 has one batch, the others two, without join. Returns the error this rank got."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=HANG_TIMEOUT))
    ddp = miniddp.DistributedDataParallel(make_model(seed=0), process_group=group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    x, y = make_dataset(n=2 * BATCH_SIZE, seed=rank).tensors
    start, error, where = time.monotonic(), None, None
    try:
        for k in range(1 if rank == 0 else 2):
            step(ddp, optimizer, x[k * BATCH_SIZE:(k + 1) * BATCH_SIZE],
                 y[k * BATCH_SIZE:(k + 1) * BATCH_SIZE])
    except RuntimeError as caught:
        message = re.sub(r"^\[[^]]*\]\s*", "", str(caught).splitlines()[0])  # gloo's file:line
        error = f"{type(caught).__name__} after {time.monotonic() - start:.1f} s: {message[:80]}"
        where = collective_of(caught)
    errors = [None] * world
    dist.all_gather_object(errors, (error, where))  # on the default group, which still works
    dist.destroy_process_group(group)  # a group that timed out is broken for good
    print0(f"\n1. without join: rank 0 has 1 batch, the others 2; the demo group's timeout is "
           f"{HANG_TIMEOUT:g} s")
    for r, (e, w) in enumerate(errors):
        print0(f"  rank {r}: " + (f"{e}\n          waiting in {w}" if e else
                                  "finished its loop and left"))
    print0("  rank 0 left after its last step; the others' second step waited in a collective\n"
           "  that rank 0 never called, until the timeout (by default 10 to 30 minutes of\n"
           "  nothing). gloo's message names a recv: its broadcast and all_reduce are made of\n"
           "  sends and receives between ranks, and it is a receive that timed out.")
    check(errors[0][0] is None, f"rank 0 had nothing left to wait for, yet got: {errors[0][0]}")
    for r in range(1, world):
        check(errors[r][0] is not None and "time" in errors[r][0].lower(),
              f"rank {r} should have timed out waiting for rank 0, got: {errors[r][0]}")
    return error


# ----- 2. join by hand -----

def train_with_join_by_hand(model, loader, divide_by_initial_world_size=True):
    """Lesson 03's loop (all_reduce every gradient after backward) made safe for uneven data.

    Every step begins with one all_reduce that counts the ranks still holding a batch. A rank
    without one stays in the loop and contributes zeros to every all_reduce; when the count is
    0, the rank that trained longest broadcasts its model and everyone leaves together.
    """
    world = dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    batches, shadowed = iter(loader), False
    while True:
        batch = next(batches, None)
        training = torch.tensor([0.0 if batch is None else 1.0])
        dist.all_reduce(training)  # how many ranks still train this step?
        if training.item() == 0:
            break
        divisor = world if divide_by_initial_world_size else training.item()
        if batch is None:  # shadow: take part in the all_reduces with zeros
            shadowed = True
            for p in model.parameters():
                dist.all_reduce(torch.zeros_like(p))
            continue
        optimizer.zero_grad()
        F.mse_loss(model(batch[0]), batch[1]).backward()
        for p in model.parameters():
            p.grad.mul_(1.0 / divisor)
            dist.all_reduce(p.grad)
        optimizer.step()
    source = torch.tensor([-1 if shadowed else dist.get_rank()])
    dist.all_reduce(source, op=dist.ReduceOp.MAX)  # the highest of the ranks that never ran out
    for p in model.parameters():
        dist.broadcast(p.detach(), src=int(source.item()))


# ----- 3. the real thing, miniddp's and torch's -----

def train_with_join(ddp, loader, divide_by_initial_world_size=True):
    """``with ddp.join()`` around an ordinary loop: all it takes. Returns this rank's losses
    and its parameters after every step it trained."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    losses, states = [], []
    with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size):
        for _epoch in range(EPOCHS):
            for x, y in loader:
                losses.append(step(ddp, optimizer, x, y).item())
                states.append([p.detach().clone() for p in ddp.parameters()])
    return losses, states


def same_on_every_rank(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone)


def on_every_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    check(world >= 2, "uneven inputs need at least 2 ranks: run with --nproc 2 or more")
    the_hang(rank, world)

    loader = uneven_loader(rank, world)
    counts = [0] * world
    dist.all_gather_object(counts, len(loader))
    print0(f"\nbatches per epoch on each rank: {counts} ({EPOCHS} epochs)\n  A rank goes straight "
           "on to its next epoch (all the epochs run inside one join), so only\n  each rank's "
           f"total counts: rank 0 trains {EPOCHS} x {counts[0]} = {EPOCHS * counts[0]} steps, "
           f"then shadows the last rank's\n  other {EPOCHS} x {counts[-1] - counts[0]} = "
           f"{EPOCHS * (counts[-1] - counts[0])}.")

    print0("\n2. join by hand: count the ranks still training, shadow with zeros, "
           "broadcast the last one's model")
    by_hand = make_model(seed=0)
    train_with_join_by_hand(by_hand, [b for _ in range(EPOCHS) for b in loader])
    check(same_on_every_rank(by_hand), "join by hand: the ranks ended with different models")
    reference = TorchDDP(make_model(seed=0))
    train_with_join(reference, loader)
    worst = max((a - b).abs().max().item()
                for a, b in zip(by_hand.parameters(), reference.parameters()))
    print0(f"  the same model on every rank; largest difference from torch's ddp.join(): "
           f"{worst:.2g}\n  (0 at 2 ranks, where a + b rounds the same in any order; at 3+ an "
           "all_reduce per parameter\n  adds the ranks in another order than torch's buckets)")
    for a, b in zip(by_hand.parameters(), reference.parameters()):
        check(torch.allclose(a, b, **BY_HAND_TOLERANCE),
              f"join by hand left torch's ddp.join() (max difference {(a - b).abs().max():.3g})")

    print0("\n3. ddp.join(): miniddp's DDP and torch's, side by side")
    for divide in (True, False):
        ours = miniddp.DistributedDataParallel(make_model(seed=0))
        theirs = TorchDDP(make_model(seed=0))
        our_losses, our_states = train_with_join(ours, loader, divide)
        _, their_states = train_with_join(theirs, loader, divide)
        first_difference = next((s for s, (a, b) in enumerate(zip(our_states, their_states))
                                 if not all(map(torch.equal, a, b))), None)
        synced = same_on_every_rank(ours)
        # After the loop, join's last act: every rank takes the model of the last to finish.
        final = [(name, (a - b).abs().max().item()) for (name, a), b in
                 zip(ours.module.named_parameters(), theirs.parameters()) if not torch.equal(a, b)]
        firsts_and_lasts = [None] * world
        dist.all_gather_object(firsts_and_lasts, (our_losses[0], our_losses[-1],
                                                  len(our_losses)))
        print0(f"  divide_by_initial_world_size={divide}:")
        for r, (first, last, steps) in enumerate(firsts_and_lasts):
            print0(f"    rank {r}: {steps} steps, loss {first:.4f} -> {last:.5f}, then shadowed "
                   f"{max(s for _, _, s in firsts_and_lasts) - steps} steps of the others")
        print0(f"    equal to torch's DDP bit for bit after every step: "
               f"{first_difference is None}; the same model on every rank after: {synced}; "
               f"the final model (after join's sync) equal to torch's: {not final}")
        check(first_difference is None, f"rank {rank}: miniddp differs from torch's DDP under "
                                        f"join after step {first_difference}")
        check(not final, f"rank {rank}: after the join, miniddp's final model differs from "
              f"torch's DDP's (though every step matched): {len(final)} tensors, the first "
              f"{final[0][0] if final else ''} by {final[0][1] if final else 0:.3g}. Join ends "
              "by giving every rank the model of the last rank to finish")
        check(synced, "after the join the ranks hold different models")
        check(our_losses[-1] < 0.2 * our_losses[0], f"rank {rank}: the loss went from "
              f"{our_losses[0]:.4f} to {our_losses[-1]:.4f}, not below 20% of it")
    return world, counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world, counts = launch(on_every_rank, args.nproc, backend="gloo")[0]
    ok(f"{world} ranks with {counts} batches per epoch: without join the others time out, "
       "with ddp.join() nobody hangs, miniddp equals torch's DDP bit for bit for both "
       "divisors, and every rank ends with torch's final model")


if __name__ == "__main__":
    main()
