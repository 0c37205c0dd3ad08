"""Lesson 08, part 2: unused parameters, buffers and two options, bit for bit against torch's.

What this adds since part 1 (``08_miniddp_vs_torch_ddp.py``, whose ``wrap``,
``train_side_by_side`` and ``differences`` it imports): the features of DDP beyond averaging
gradients, each trained beside torch's DDP and compared as raw bits after every step.

* **unused parameters.** A parameter that takes no part in the loss never gets a gradient, so
  its bucket never fills and the next forward fails, on both DDPs (shown). With
  ``find_unused_parameters=True`` each forward walks the autograd graph and marks what it cannot
  reach as ready, with zeros: a parameter unused on some ranks gets the others' sum divided by
  the *whole* world size; one unused everywhere keeps ``.grad = None``.
* **buffers.** BatchNorm's running statistics are updated by each rank in forward. DDP
  broadcasts rank 0's at the start of every forward that follows a synchronized one, so after
  training the ranks' statistics differ and an evaluation forward gives every rank rank 0's.
* **static_graph=True**, on a block checkpointed twice (reentrant): its gradients arrive twice
  per backward, and are ready only at the second arrival. The first backward counts the
  arrivals; later ones reduce a gradient when its count is reached.
* **gradient_as_bucket_view=True**: each ``.grad`` lives in its bucket, so backward accumulates
  straight into it and is divided there, in place (``grad / world_size``, as torch does; at 3
  ranks not the bits of ``grad * (1 / world_size)``). Gradients are zeroed in place here, so the
  views survive from step to step.

Run it:

    python lessons/08_miniddp_vs_torch_ddp_extras.py            # 2 ranks, and 3 for the options
    python lessons/08_miniddp_vs_torch_ddp_extras.py --nproc 3
    torchrun --standalone --nproc_per_node=3 lessons/08_miniddp_vs_torch_ddp_extras.py

What you should see: the error both DDPs raise without ``find_unused_parameters``; "equal to
torch's DDP bit for bit" with BatchNorm and unused heads; the statistics equal only after an
evaluation forward; each option equal at 2 ranks and again at 3; ``OK: ...``. About 15 s.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

import miniddp
from course.data import OUT_FEATURES, make_dataset, make_model, shard
from course.report import Progress, check, ok, print0
from course.tools import load_lesson
from miniddp.checks.bits import same_bits
from miniddp.launch import launch, launched_by_torchrun, rank_device

part1 = load_lesson("08_miniddp_vs_torch_ddp")
wrap, train_side_by_side, BATCH_SIZE = part1.wrap, part1.train_side_by_side, part1.BATCH_SIZE
EPOCHS, BUCKET_CAP_MB = part1.EPOCHS, part1.BUCKET_CAP_MB


class StudentWithExtras(nn.Module):
    """Lesson 00's student with BatchNorm after its first layer, and two extra heads:
    ``sometimes`` joins the output on some ranks and steps only, ``never`` is never used."""

    def __init__(self, seed: int, hidden: int = 64):
        super().__init__()
        student = make_model(seed=seed, hidden=hidden)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.body = nn.Sequential(student[0], nn.BatchNorm1d(hidden), student[1])
            self.head = student[2]
            self.sometimes = nn.Linear(hidden, OUT_FEATURES)
            self.never = nn.Linear(hidden, OUT_FEATURES)

    def forward(self, x, use_sometimes: bool = False):
        h = self.body(x)
        return self.head(h) + self.sometimes(h) if use_sometimes else self.head(h)


class BlockCheckpointedTwice(nn.Module):
    """A block applied twice, each time under reentrant checkpointing: its parameters'
    gradients arrive twice in one backward, and are ready only at the second arrival."""

    def __init__(self, seed: int, hidden: int = 32):
        super().__init__()
        student = make_model(seed=seed, hidden=hidden)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed, self.head = student[0], student[2]
            self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        for _ in range(2):
            h = checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


def unused_without_the_flag(rank, device):
    """Both DDPs refuse, at the next forward, a model whose loss left parameters unused."""
    x, y = (t.to(device) for t in make_dataset(n=BATCH_SIZE, seed=10 + rank).tensors)
    model = StudentWithExtras(seed=0)
    print0("\nwithout find_unused_parameters, 'sometimes' and 'never' block their bucket:")
    for name, ddp_class in (("miniddp", miniddp.DistributedDataParallel), ("torch", TorchDDP)):
        ddp = wrap(ddp_class, model, device)
        F.mse_loss(ddp(x), y).backward()
        try:
            ddp(x)
            error = "no error"
        except RuntimeError as e:
            error = str(e)
        print0(f"  {name:<7} raises at the next forward: {error[:80]}...")
        check("Expected to have finished reduction in the prior iteration" in error,
              f"{name}: a forward after a backward that left parameters without gradients "
              f"should fail, got: {error[:300]}")


def with_buffers_and_unused_heads(rank, world, device):
    """BatchNorm buffers and parameters that only some ranks use, on both DDPs."""
    model = StudentWithExtras(seed=rank)
    ours = wrap(miniddp.DistributedDataParallel, model, device, find_unused_parameters=True)
    theirs = wrap(TorchDDP, model, device, find_unused_parameters=True)
    loader = DataLoader(shard(make_dataset(n=2048, seed=0), rank, world),
                        batch_size=BATCH_SIZE, drop_last=True)
    used = lambda step: {"use_sometimes": (step + rank) % 3 == 0}  # per rank and step
    progress = Progress(EPOCHS * len(loader), quiet=True)
    first_difference, layouts = train_side_by_side([ours, theirs], loader, device, used,
                                                   progress)
    check(first_difference[0] is None, f"rank {rank}: with BatchNorm and unused heads, miniddp "
                                       f"differs from torch's DDP after step "
                                       f"{first_difference[0]}")
    losses = progress.losses()
    check(losses[-1] < 0.2 * losses[0], f"with BatchNorm the loss went from {losses[0]:.4f} to "
                                        f"{losses[-1]:.4f}, not below 20% of it")
    print0(f"\nwith find_unused_parameters=True, BatchNorm, a head used on some ranks and steps "
           f"and one never used:\n  equal to torch's DDP bit for bit after each of the "
           f"{len(layouts)} steps (loss {losses[0]:.3f} -> {losses[-1]:.4f})")
    never = [m.module.never.weight.grad for m in (ours, theirs)]
    check(never == [None, None], "a parameter no rank ever used must keep .grad = None")
    print0("  'never' was unused on every rank: its .grad is still None on both")

    bn = [m.module.body[1].running_mean for m in (ours, theirs)]
    before = rank_agreement(bn[0])
    ours.eval(), theirs.eval()
    with torch.no_grad():  # the forward before was synchronized: this one broadcasts first
        x = make_dataset(n=BATCH_SIZE, seed=20 + rank).tensors[0].to(device)
        ours(x), theirs(x)
    after = rank_agreement(bn[0])
    say = {True: "yes", False: "no"}
    print0(f"  BatchNorm running_mean equal on every rank? after the last training forward: "
           f"{say[before]} (each rank updated its own);\n  after one evaluation forward through "
           f"the wrapper: {say[after]} (rank 0's, broadcast at its start, since the forward "
           "before it was a synchronized one)")
    check(not before or world == 1, "each rank updated its running statistics with its own "
                                    "batch: they should differ after training")
    check(after and same_bits(bn[0], bn[1]),
          "an evaluation forward through DDP should give every rank rank 0's statistics")


def two_options(rank, world, device):
    """``static_graph`` on a block whose gradients arrive twice per backward (ready at the
    second arrival only), and ``gradient_as_bucket_view`` on the student. Gradients are zeroed
    in place, so that from step 1 on each ``.grad`` is its bucket's view and is divided there,
    in place, as torch divides it (at 3 ranks ``grad / 3`` and ``grad * (1 / 3)`` differ)."""
    loader = DataLoader(shard(make_dataset(n=256 * world, seed=1), rank, world),
                        batch_size=BATCH_SIZE, drop_last=True)
    print0("\ntwo options, gradients zeroed in place:")
    for option, model, what in (
            ("static_graph", BlockCheckpointedTwice(seed=rank),
             "a block checkpointed twice, its gradients arriving twice per backward"),
            ("gradient_as_bucket_view", make_model(seed=rank), "the student")):
        ours, theirs = (wrap(cls, model, device, bucket_cap_mb=BUCKET_CAP_MB, **{option: True})
                        for cls in (miniddp.DistributedDataParallel, TorchDDP))
        first_difference, layouts = train_side_by_side([ours, theirs], loader, device,
                                                       set_to_none=False)
        step, names = first_difference[0] or (None, [])
        check(step is None, f"rank {rank}: with {option}=True, at {world} ranks miniddp differs "
                            f"from torch's DDP after step {step}, in {', '.join(names)}")
        print0(f"  {option}=True, {what}: equal to torch's DDP bit for bit after each of the "
               f"{len(layouts)} steps, at {world} ranks")


def rank_agreement(t) -> bool:
    """Is ``t`` the same on every rank (a collective)?"""
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(same_bits(everyone[0], other) for other in everyone)


def on_every_rank():
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    unused_without_the_flag(rank, device)
    with_buffers_and_unused_heads(rank, world, device)
    two_options(rank, world, device)
    return world


def options_at_three_ranks():
    two_options(dist.get_rank(), dist.get_world_size(), rank_device())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world = launch(on_every_rank, args.nproc)[0]
    at_three = world >= 3
    if not at_three and not launched_by_torchrun():
        print0("\nthe two options again at 3 ranks (3 ranks forked anew), where dividing and "
               "multiplying differ:")
        launch(options_at_three_ranks, 3)
        at_three = True
    ok(f"unused parameters, BatchNorm buffers, static_graph and gradient_as_bucket_view: "
       f"miniddp equal to torch's DDP bit for bit on {world} ranks"
       + " and the options at 3 ranks too" * (at_three and world < 3))


if __name__ == "__main__":
    main()
