"""Lesson 07, part 2: what ``no_sync`` does not do: nest blindly, or cancel a reduction.

What this adds since part 1 (``07_no_sync_accumulation.py``, whose ``FlagReadAtForward`` and
helpers it imports): two rules that follow from the flag and the note, each shown on miniddp,
torch's DDP (and the version by hand where it applies), and checked.

* **no_sync restores the flag it found.** A helper that accumulates with its own ``no_sync``,
  called inside the training loop's, must leave the outer block accumulating when it returns:
  leaving ``no_sync`` puts back the value it found (False there), not True. A backward in the
  outer block after the inner one ended must not synchronize.
* **no_sync cancels nothing.** A forward with grad enabled that no backward follows (validation
  without ``torch.no_grad()``) prepared a reduction; ``no_sync`` only stops a forward from
  preparing one. So the next backward, even inside ``no_sync``, is the one that reduction waits
  for, and it all_reduces, in torch's DDP and in miniddp alike, down to a model with
  ``find_unused_parameters=True`` and an output the loss ignores: DDP passes every forward's
  outputs through one identity autograd function (torch's ``_DDPSink``,
  ``miniddp.options.unused``), inside ``no_sync`` too, so the parameters behind the ignored
  output still report in and the reduction completes. Validate under ``torch.no_grad()``.

Run it:

    python lessons/07_no_sync_accumulation_traps.py              # 2 ranks, gloo on CPU
    torchrun --standalone --nproc_per_node=2 lessons/07_no_sync_accumulation_traps.py

What you should see: the nested case "NOT synchronized" on all three; the no_sync micro-batch
after a validation forward "synchronized" on both DDPs, with their gradients equal bit for bit
(both warn that find_unused_parameters found nothing unused: said in one line); ``OK: ...``.
About 15 s.
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from course.data import IN_FEATURES, make_dataset, make_model
from course.report import check, cpp_stderr, ok, print0
from course.tools import load_lesson
from miniddp.launch import launch, rank_device

part1 = load_lesson("07_no_sync_accumulation")
wrap, grads_agree_across_ranks = part1.wrap, part1.grads_agree_across_ranks
FlagReadAtForward = part1.FlagReadAtForward


# ----- no_sync inside no_sync -----

def nested_no_sync(rank, device):
    """A helper that accumulates with its own ``no_sync``, called inside the loop's: leaving
    the inner block must restore the flag it found (False), so the outer one goes on
    accumulating."""
    x, y = (t.to(device) for t in make_dataset(n=16, seed=30 + rank).tensors)
    seen = {}
    for name, ddp_class in (("miniddp", miniddp.DistributedDataParallel), ("torch", TorchDDP),
                            ("by hand", FlagReadAtForward)):
        ddp = wrap(ddp_class, make_model(seed=0).to(device), device)
        with ddp.no_sync():
            with ddp.no_sync():
                F.mse_loss(ddp(x), y).backward()
            F.mse_loss(ddp(x), y).backward()  # after the inner block, inside the outer one
            seen[name] = grads_agree_across_ranks(ddp)
    print0("\nno_sync inside no_sync, then a micro-batch in the outer block only: " + ", ".join(
        f"{name}: {'synchronized' if synced else 'NOT synchronized'}"
        for name, synced in seen.items()))
    for name, synced in seen.items():
        check(not synced, f"{name}: a backward inside the outer no_sync, after an inner no_sync "
              "ended, synchronized: leaving no_sync must restore the flag it found (False "
              "here), not set it to True")


# ----- a forward that no backward follows -----


class WithIgnoredHead(nn.Module):
    """The lesson's model, plus a second output that the training loss never uses."""

    def __init__(self):
        super().__init__()
        self.body = make_model(seed=0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.ignored = nn.Linear(IN_FEATURES, 1)

    def forward(self, x):
        return self.body(x), self.ignored(x)


def warned_nothing_unused(captured: list) -> bool:
    """True when this DDP warned that it found no unused parameter; anything else captured is
    passed on to stderr as it was, so that nothing unexpected is hidden."""
    lines = "".join(captured).splitlines(keepends=True)
    warned = [line for line in lines if "did not find any unused parameters" in line]
    sys.stderr.write("".join(line for line in lines if line not in warned))
    return bool(warned)


def the_forward_without_backward(rank, device):
    """Validation without ``torch.no_grad()``, then a step whose first micro-batch runs in
    ``no_sync``: that micro-batch is synchronized after all, in both DDPs, bit for bit."""
    print0("\na forward without backward (validation without no_grad), then a micro-batch "
           "inside no_sync")
    x, y = (t.to(device) for t in make_dataset(n=48, seed=20 + rank).tensors)
    results, warned = {}, []
    for name, ddp_class in (("miniddp", miniddp.DistributedDataParallel), ("torch", TorchDDP)):
        ddp = ddp_class(WithIgnoredHead().to(device), find_unused_parameters=True,
                        device_ids=[device.index] if device.type == "cuda" else None)
        captured = []
        with cpp_stderr(captured):  # both DDPs print a warning here (said below)
            ddp(x[32:])  # "validation", grad enabled: it prepares a reduction no backward runs
        if warned_nothing_unused(captured):
            warned.append(name)
        with ddp.no_sync():  # ... so no_sync cancels nothing: this backward is reduced
            prediction, _ignored = ddp(x[:16])
            F.mse_loss(prediction, y[:16]).backward()
        reduced_in_no_sync = grads_agree_across_ranks(ddp.module.body)
        try:  # had the ignored head not reported in, this forward would raise
            prediction, _ignored = ddp(x[16:32])
        except RuntimeError as error:
            check(False, f"{name}: the reduction that the validation forward prepared never "
                         f"completed: {str(error).splitlines()[0]}")
        F.mse_loss(prediction, y[16:32]).backward()
        results[name] = (reduced_in_no_sync, [p.grad for p in ddp.module.body.parameters()],
                         ddp.module.ignored.weight.grad)

    if warned:
        print0(f"  ({' and '.join(warned)} warned that find_unused_parameters=True found no "
               "unused parameter in the validation forward: true, every parameter is reached "
               "from an output, the ignored head too; only the loss, after forward, ignores it)")
    for name, (reduced, _, _) in results.items():
        print0(f"  {name}: the no_sync micro-batch was "
               f"{'synchronized' if reduced else 'NOT synchronized'}")
    for name, (reduced, _, ignored_grad) in results.items():
        check(reduced, f"{name}: the backward after a forward that no backward followed was not "
                       "synchronized; that forward's reduction must still be waiting for it")
        check(ignored_grad is None, f"{name}: the ignored head got a gradient")
    same = all(torch.equal(a, b) for a, b in zip(results["miniddp"][1], results["torch"][1]))
    check(same, f"rank {rank}: after a forward without backward, miniddp's gradients differ "
                "from torch's DDP")
    print0("  miniddp's gradients equal torch's DDP's bit for bit; validate under "
           "torch.no_grad() to avoid all of it")


def on_every_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    check(world >= 2, "no_sync only matters with someone to synchronize with: run 2+ ranks")
    device = rank_device()
    nested_no_sync(rank, device)
    the_forward_without_backward(rank, device)
    return world


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world = launch(on_every_rank, args.nproc)[0]
    ok(f"on {world} ranks no_sync restored the flag it found when nested, and cancelled no "
       "reduction a forward without backward had prepared, as in torch's DDP")


if __name__ == "__main__":
    main()
