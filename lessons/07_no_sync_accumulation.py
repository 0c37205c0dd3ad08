"""Lesson 07: gradient accumulation with ``no_sync``, one all_reduce per k micro-batches.

What this adds since lesson 06: batches larger than memory. Split the batch into k
micro-batches, run forward and backward on each, let ``.grad`` add them up, step once. A plain
DDP loop would all_reduce after every backward; ``ddp.no_sync()`` skips that for the first k - 1,
and the last, synchronized backward averages the whole accumulated gradient once: the same
mean gradient for a k-th of the communication.

Why it matters: the effective batch becomes ``ranks x k x micro-batch`` at the memory cost of
one micro-batch. With ``loss / k`` and one ``zero_grad()`` per step this is the gradient of the
mean loss over the whole batch: lesson 00's one-process oracle (up to float rounding) and
torch's DDP (bit for bit). Forgetting ``/ k``, or zeroing per micro-batch, silently breaks it.

The idea in a dozen lines (``FlagReadAtForward``): ``no_sync`` sets a flag, forward copies it
into a note for the backward it starts, and the gradient hooks read only the note. So **where
forward runs decides**: a forward inside ``no_sync`` with its backward outside does not
synchronize; a forward outside with its backward inside does. Shown on miniddp, torch's DDP and
the version by hand; ``FlagReadAtBackward``, whose hooks read the flag itself, does the
opposite in both cases. Keep forward and backward inside the ``with``. Part 2
(``07_no_sync_accumulation_traps.py``) shows what ``no_sync`` does not do.

Run it:

    python lessons/07_no_sync_accumulation.py                      # 2 ranks, gloo on CPU
    python lessons/07_no_sync_accumulation.py --nproc 3 --micro-batches 8
    torchrun --standalone --nproc_per_node=2 lessons/07_no_sync_accumulation.py

With one GPU per rank (``--nproc N`` on N GPUs) it uses NCCL.

What you should see: in the first step's table, all_reduce calls only in the last micro-batch
and the ranks' gradients equal only after it; the loss falling; a k-th of a plain loop's
all_reduces; miniddp equal to torch's DDP bit for bit and close to the oracle; the trap
behaving alike on both DDPs and by hand; ``OK: ...``. About 20 s.
"""

import argparse
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, Subset

import miniddp
from course.data import make_dataset, make_model, shard
from course.report import Progress, check, ok, print0
from miniddp.launch import launch, rank_device

MICRO_BATCH = 16  # samples per micro-batch on each rank
EPOCHS = 6
LR = 0.2
# The oracle computes the same mean gradient with its float additions in another order: one
# matrix product sums over the whole batch, where here .grad adds k micro-batch sums and then
# the all_reduce adds the ranks' shares. Each order rounds differently in the last bits (about
# 1e-7 relative), and training carries those differences along. So: close, not equal.
ORACLE_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def wrap(ddp_class, model, device):
    """Wrap ``model`` in a DDP class (miniddp's or torch's), one GPU per rank when on GPU."""
    return ddp_class(model, device_ids=[device.index] if device.type == "cuda" else None)


def reducer_launches(ddp) -> int:
    """All_reduce calls miniddp's reducer has launched since its timeline was switched on.

    ``ddp.allreduce_calls`` counts the calls of the last *synchronized* backward; the timeline
    (lesson 06) also shows that a backward inside ``no_sync`` launches nothing.
    """
    return sum(event == "launch" for event, _, _ in ddp.reducer.timeline)


def grads_agree_across_ranks(model) -> bool:
    """True when every rank holds the very same gradients (a collective: every rank calls it)."""
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], g) for g in everyone)


def accumulation_step(ddp, optimizer, micro_batches, after_backward=None):
    """One optimizer step from k micro-batches: forward *and* backward of the first k - 1
    inside ``no_sync``, the last pair synchronized. Returns the loss of the whole step."""
    k = len(micro_batches)
    optimizer.zero_grad()  # once per step, not per micro-batch: .grad must accumulate
    step_loss = 0.0
    for j, (x, y) in enumerate(micro_batches):
        with ddp.no_sync() if j < k - 1 else nullcontext():
            loss = F.mse_loss(ddp(x), y) / k  # / k: .grad adds up to the mean over all k
            loss.backward()
        step_loss += loss.detach()
        if after_backward:
            after_backward()
    optimizer.step()
    return step_loss


def train(rank, world, k, device):
    """Train miniddp's DDP, torch's DDP and the one-process oracle side by side."""
    data = make_dataset(n=2048, seed=0)
    mine = shard(data, rank, world)  # samples rank, rank + world, ...: this rank's share
    loader = DataLoader(mine, batch_size=k * MICRO_BATCH, drop_last=True)
    # The oracle's batch s is the union of every rank's batch s: the same samples, in one piece.
    everything = DataLoader(Subset(data, range(len(mine) * world)),
                            batch_size=world * k * MICRO_BATCH, drop_last=True)

    ours = wrap(miniddp.DistributedDataParallel, make_model(seed=0).to(device), device)
    theirs = wrap(TorchDDP, make_model(seed=0).to(device), device)
    oracle = make_model(seed=0).to(device)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
                  for m in (ours, theirs, oracle)]
    ours.reducer.timeline = []  # record the reducer's launches, to count them
    marks = []  # after every micro-batch: (launches so far, gradients equal on every rank)

    def after_backward():
        marks.append((reducer_launches(ours), grads_agree_across_ranks(ours)))

    print0(f"{world} ranks x {k} micro-batches x {MICRO_BATCH} samples = a batch of "
           f"{world * k * MICRO_BATCH} per optimizer step\n")
    steps = EPOCHS * len(loader)
    progress = Progress(steps, every=max(1, steps // 8))
    step, worst, first_mismatch = 0, 0.0, None
    for _epoch in range(EPOCHS):
        for (x, y), (big_x, big_y) in zip(loader, everything):
            micro_batches = list(zip(x.to(device).chunk(k), y.to(device).chunk(k)))
            loss = accumulation_step(ours, optimizers[0], micro_batches, after_backward)
            accumulation_step(theirs, optimizers[1], micro_batches)
            optimizers[2].zero_grad()
            F.mse_loss(oracle(big_x.to(device)), big_y.to(device)).backward()
            optimizers[2].step()
            progress(loss)

            for a, b, c in zip(ours.parameters(), theirs.parameters(), oracle.parameters()):
                if first_mismatch is None and not torch.equal(a, b):
                    first_mismatch = step
                worst = max(worst, (a - c).abs().max().item())
            step += 1
    return ours, oracle, progress.losses(), marks, worst, first_mismatch


def check_communication(ours, marks, k):
    """One all_reduce round per step, in its last micro-batch; gradients local until then."""
    steps, buckets = len(marks) // k, len(ours.buckets)
    launched = [n for n, _ in marks]
    calls = [b - a for a, b in zip([0] + launched, launched)]
    agree = [same for _, same in marks]
    print0(f"\nthe first step, micro-batch by micro-batch ({buckets} bucket here, so a synced "
           "backward makes one all_reduce per bucket):")
    print0("  micro-batch  forward/backward   all_reduce calls   gradients equal on every rank")
    for j in range(k):
        where = "inside no_sync" if j < k - 1 else "synchronized  "
        print0(f"  {j:>11}  {where}   {calls[j]:>16}   {'yes' if agree[j] else 'no'}")
    expected_calls = [0] * (k - 1) + [buckets]
    expected_agree = [False] * (k - 1) + [True]
    for s in range(steps):  # the messages say what was seen, both counts, and guess no cause
        seen = (f"step {s}, micro-batch by micro-batch: all_reduce calls "
                f"{calls[s * k:(s + 1) * k]} (expected {expected_calls}), gradients equal on "
                f"every rank afterwards {agree[s * k:(s + 1) * k]} (expected {expected_agree})")
        check(calls[s * k:(s + 1) * k] == expected_calls, seen)
        check(agree[s * k:(s + 1) * k] == expected_agree, seen + (
            ". The all_reduces were launched as expected, yet the ranks' .grad do not hold "
            "their common average after the last backward" if agree[(s + 1) * k - 1] is False
            else ""))
    check(ours.allreduce_calls == buckets, f"ddp.allreduce_calls says {ours.allreduce_calls} "
                                           f"for {buckets} bucket(s)")
    return sum(calls), steps * k


def calls_without_no_sync(rank, k, device) -> int:
    """The same step with every backward synchronized: k all_reduce rounds instead of one."""
    ddp = wrap(miniddp.DistributedDataParallel, make_model(seed=0).to(device), device)
    x, y = (t.to(device) for t in make_dataset(n=k * MICRO_BATCH, seed=10 + rank).tensors)
    calls = 0
    for xm, ym in zip(x.chunk(k), y.chunk(k)):
        (F.mse_loss(ddp(xm), ym) / k).backward()
        calls += ddp.allreduce_calls  # the calls of this (synchronized) backward
    return calls


# ----- by hand: why forward decides -----


class FlagReadAtForward(nn.Module):
    """``no_sync`` by hand: the flag is copied, at forward time, into a note for the backward
    that forward starts, and the gradient hooks read the note, never the flag. torch's DDP does
    the same: its forward calls ``reducer.prepare_for_backward`` only when the flag allows, and
    that call is what arms its hooks for one backward (``expect_autograd_hooks_`` in
    reducer.cpp; ``miniddp.reducer``'s ``prepare_for_backward``). Averages one parameter at a
    time, where DDP averages buckets (lesson 05)."""

    def __init__(self, module: nn.Module, device_ids=None):
        super().__init__()
        self.module, self.require_backward_grad_sync = module, True
        self.sync_this_backward, self.all_reduces = False, 0
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    @contextmanager
    def no_sync(self):
        old = self.require_backward_grad_sync  # restored, not set to True: no_sync may nest
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, *inputs):
        self.sync_this_backward = self.require_backward_grad_sync  # the flag, read HERE
        return self.module(*inputs)

    def on_grad_ready(self, param):
        if self.sync_this_backward:  # what forward noted, whatever the flag says now
            param.grad.mul_(1.0 / dist.get_world_size())
            dist.all_reduce(param.grad)
            self.all_reduces += 1


class FlagReadAtBackward(FlagReadAtForward):
    """The same, with the hooks reading the flag itself: what the trap below would show if
    backward decided. Neither DDP behaves like this."""

    def on_grad_ready(self, param):
        self.sync_this_backward = self.require_backward_grad_sync
        super().on_grad_ready(param)


def all_reduces(ddp) -> int:
    """All_reduce calls so far: miniddp's reducer timeline, or the by-hand wrapper's count."""
    return reducer_launches(ddp) if hasattr(ddp, "reducer") else ddp.all_reduces


def the_trap(rank, device):
    """``no_sync`` is read when forward runs. Shown on both DDPs and on the wrapper by hand
    (read at forward time, and read at backward time); returns what each did."""
    x, y = (t.to(device) for t in make_dataset(n=32, seed=10 + rank).tensors)
    synced, grads = {}, {}
    for name, ddp_class in (("miniddp", miniddp.DistributedDataParallel), ("torch", TorchDDP),
                            ("by hand", FlagReadAtForward),
                            ("by hand, read at backward", FlagReadAtBackward)):
        ddp = wrap(ddp_class, make_model(seed=0).to(device), device)
        if name == "miniddp":
            ddp.reducer.timeline = []  # to count its launches
        with ddp.no_sync():
            out = ddp(x)  # forward inside no_sync ...
        F.mse_loss(out, y).backward()  # ... backward outside: NOT synchronized
        forward_inside = grads_agree_across_ranks(ddp)
        grads[name] = [torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])]
        ddp.zero_grad()
        out = ddp(x)  # forward outside ...
        launches = all_reduces(ddp) if name != "torch" else None
        with ddp.no_sync():
            F.mse_loss(out, y).backward()  # ... backward inside: synchronized all the same
        launched = None if launches is None else all_reduces(ddp) - launches
        synced[name] = (forward_inside, grads_agree_across_ranks(ddp), launched)
        grads[name].append(torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]))

    word = {True: "synchronized", False: "NOT synchronized"}
    print0("\nthe trap: where forward runs decides, not where backward runs")
    for case, label in enumerate(("forward inside no_sync, backward outside",
                                  "forward outside, backward inside no_sync")):
        print0(f"  {label}:\n    " + ",  ".join(f"{name}: {word[synced[name][case]]}"
                                                 for name in synced))
    backward_reads = synced.pop("by hand, read at backward")
    check(backward_reads[:2] == (True, False), "the wrapper whose hooks read the flag at backward "
          f"time synchronized {backward_reads[:2]} in the two cases; expected (True, False), the "
          "opposite of both DDPs: else this table cannot tell the two readings apart")
    for name, (forward_inside, backward_inside, launched) in synced.items():
        check(not forward_inside, f"{name}: after a forward inside no_sync and its backward "
              "outside, every rank held the same gradients; expected each rank's own (the "
              "flag is read at forward time)")
        calls = "" if launched is None else f"; that backward launched {launched} all_reduce(s)"
        check(backward_inside, f"{name}: after a forward outside no_sync and its backward "
              f"inside, the ranks held different gradients{calls}; expected the same averaged "
              "gradients on every rank (the flag is read at forward time)")
    for case, said in enumerate(("inside no_sync, backward outside", "outside, backward inside")):
        diff = (grads["by hand"][case] - grads["torch"][case]).abs().max().item()
        check(torch.allclose(grads["by hand"][case], grads["torch"][case], rtol=1e-6, atol=1e-8),
              f"rank {rank}: forward {said}: the wrapper by hand left other gradients than "
              f"torch's DDP (largest difference {diff:.3g}); expected the same, up to the "
              "rounding of averaging per parameter instead of per bucket")
    params = len(list(make_model(seed=0).parameters()))
    check(synced["by hand"][2] == params, f"forward outside no_sync, backward inside: the "
          f"wrapper by hand made {synced['by hand'][2]} all_reduces, expected {params} (one per "
          "parameter: the note forward left was set)")
    print0("  the wrapper by hand, which reads the flag in forward, does what both DDPs do")


def on_every_rank(k):
    rank, world = dist.get_rank(), dist.get_world_size()
    check(world >= 2, "no_sync only matters with someone to synchronize with: run 2+ ranks")
    check(k >= 2, f"--micro-batches must be at least 2 to accumulate anything, got {k}")
    device = rank_device()

    ours, oracle, losses, marks, worst, first_mismatch = train(rank, world, k, device)
    check(losses[-1] < 0.2 * losses[0],
          f"the loss went from {losses[0]:.4f} to {losses[-1]:.4f}, not below 20% of it")

    calls, backwards = check_communication(ours, marks, k)
    plain = calls_without_no_sync(rank, k, device)
    steps = backwards // k
    print0(f"\n{backwards} backward passes in {steps} steps made {calls} all_reduce calls; "
           f"without no_sync one step alone makes {plain}, {steps * plain} in all")
    check(plain == k * len(ours.buckets), f"without no_sync one step made {plain} all_reduce "
                                          f"calls, expected {k} x {len(ours.buckets)}")

    print0(f"largest difference from the one-process oracle (batch {world * k * MICRO_BATCH}) "
           f"in any parameter at any step: {worst:.2g} (close, not equal: float additions in "
           "another order)")
    for a, c in zip(ours.parameters(), oracle.parameters()):
        check(torch.allclose(a, c, **ORACLE_TOLERANCE),
              f"rank {rank}: miniddp's parameters left the one-process oracle "
              f"(max difference {(a - c).abs().max().item():.3g})")
    check(first_mismatch is None, f"rank {rank}: miniddp's parameters differ from torch's DDP "
                                  f"after step {first_mismatch}")
    print0(f"miniddp's parameters equal torch's DDP's bit for bit after each of the {steps} "
           "steps")

    the_trap(rank, device)
    return world, steps, losses[0], losses[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="micro-batches accumulated per optimizer step (k)")
    args = parser.parse_args()
    world, steps, first, last = launch(on_every_rank, args.nproc, (args.micro_batches,))[0]
    ok(f"{args.micro_batches} micro-batches per step on {world} ranks: one all_reduce round per "
       f"step, loss {first:.3f} -> {last:.4f}, equal to torch's DDP bit for bit and to the "
       "one-process oracle within float rounding; no_sync is read at forward time")


if __name__ == "__main__":
    main()
