"""Lesson 08: the whole miniddp DistributedDataParallel, bit for bit against torch's.

What this adds since lesson 07: the proof that the pieces of lessons 03-07 together are torch's
DDP. ``miniddp.DistributedDataParallel`` trains beside ``torch.nn.parallel.
DistributedDataParallel`` on the same batches, and after every step every parameter, gradient
and buffer must be equal as raw bits (not ``allclose``, nor ``torch.equal``, for which
``0.0 == -0.0``). Along come what a simple reimplementation gets wrong:

* **the bucket rebuild**: one bucket in model order for the first backward, then buckets in
  the order gradients arrived, cut at ``bucket_cap_mb``: compared with torch's C++ reducer's
  buckets at every step.
* **unused parameters**: without ``find_unused_parameters`` both DDPs fail at the next forward;
  with it, a parameter unused on some ranks gets the others' sum over the *whole* world size.
* **buffers**: BatchNorm's statistics are broadcast from rank 0 at a forward that follows a
  synchronized one, so an evaluation forward gives every rank rank 0's.
* **two options**: ``static_graph`` on a block checkpointed twice (its gradients arrive twice
  per backward and are ready at the second), ``gradient_as_bucket_view`` (each ``.grad`` lives
  in its bucket and is divided there, in place).

Why 3 ranks are the harder test: at 2, ``a + b == b + a`` and halving is exact, so any bucket
layout and ``grad / 2`` or ``grad * (1 / 2)`` give the same bits. At 3, gloo's ring adds in an
order set by the bucket layout, and ``grad / 3 != grad * (1 / 3)``. Two controls show it, one
cause each: a miniddp with other buckets, and torch's DDP with its own dividing
``allreduce_hook``. Both match at 2 ranks, neither at 3, while miniddp still does. Run on 2
ranks, the lesson forks 3 more for that part (under torchrun: ``--nproc_per_node=3``).

Run it:

    python lessons/08_miniddp_vs_torch_ddp.py              # 2 ranks, gloo on CPU
    python lessons/08_miniddp_vs_torch_ddp.py --nproc 3    # the harder test
    torchrun --standalone --nproc_per_node=2 lessons/08_miniddp_vs_torch_ddp.py

With one GPU per rank it uses NCCL; the claim then rests on both DDPs calling NCCL alike.

What you should see: the buckets before and after the rebuild; "equal bit for bit after each of
the ... steps" for the student, for BatchNorm with unused heads, and for each option; the error
both DDPs raise without ``find_unused_parameters``; the statistics equal after an evaluation
forward; the controls equal at 2 ranks and not at 3; ``OK: ...``. About 15 s.
"""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

import miniddp
from miniddp.launch import launch, launched_by_torchrun, rank_device
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET
from miniddp.train.data import OUT_FEATURES, make_dataset, make_model, shard
from miniddp.train.report import Progress, check, ok, print0

BATCH_SIZE = 32  # per rank
EPOCHS = 2
LR = 0.2
BUCKET_CAP_MB = 0.0005  # about 520 bytes: two buckets for lesson 00's student after the rebuild


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


def wrap(ddp_class, module, device, **kwargs):
    """Wrap a copy of ``module`` in a DDP class (miniddp's or torch's), one GPU per rank on GPU.

    Before torch 2.4 a cap left the first bucket at 1 MiB (``miniddp.torch_versions``), which
    would hold the whole student: there the first bucket is capped too, while both are built.
    """
    ids = [device.index] if device.type == "cuda" else None
    saved = dist._DEFAULT_FIRST_BUCKET_BYTES
    if not EXPLICIT_CAP_COVERS_FIRST_BUCKET and kwargs.get("bucket_cap_mb") is not None:
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(kwargs["bucket_cap_mb"] * 2**20)
    try:
        return ddp_class(copy.deepcopy(module).to(device), device_ids=ids, **kwargs)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: unlike ``torch.equal``, 0.0 and -0.0 differ, and NaN equals itself."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().view(as_int), b.detach().view(as_int))


def differences(ours, theirs) -> list[str]:
    """Names of the parameters, gradients and buffers that are not equal bit for bit."""
    found = []
    for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
        if not same_bits(a, b):
            found.append(name)
        if (a.grad is None) != (b.grad is None) or (
                a.grad is not None and not same_bits(a.grad, b.grad)):
            found.append(f"{name}.grad")
    for (name, a), b in zip(ours.module.named_buffers(), theirs.module.buffers()):
        if not same_bits(a, b):
            found.append(name)
    return found


def torch_buckets(theirs) -> list[list[int]]:
    """The buckets inside torch's C++ reducer, as indices into the parameter list."""
    index = {id(p): i for i, p in enumerate(theirs.module.parameters())}
    return [[index[id(p)] for p in bucket.parameters()]
            for bucket in theirs.reducer._get_zeros_like_grad_buckets()]


def show_buckets(title, ddp):
    print0(title)
    for info in ddp.buckets:
        print0(f"  bucket {info.index}: {', '.join(info.names):<32} {info.numel:>5} "
               f"{info.dtype} elements, {info.nbytes} bytes")


def train_side_by_side(models, loader, device, forward_kwargs=None, progress=None,
                       set_to_none=True):
    """Train every wrapped model on the same batches; after every step compare each one with
    ``models[1]`` (torch's). Returns, per model, the first step where it differed (or None),
    and the bucket layouts of ``models[0]`` and of torch's after every step."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    first_difference = [None] * len(models)
    layouts, step = [], 0
    for _epoch in range(EPOCHS):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            kwargs = forward_kwargs(step) if forward_kwargs else {}
            for model, optimizer in zip(models, optimizers):
                optimizer.zero_grad(set_to_none=set_to_none)
                loss = F.mse_loss(model(x, **kwargs), y)
                loss.backward()
                optimizer.step()
                if model is models[0] and progress:
                    progress(loss)
            for k, model in enumerate(models):
                if first_difference[k] is None and differences(model, models[1]):
                    first_difference[k] = (step, differences(model, models[1]))
            layouts.append(([b.param_indices for b in models[0].buckets],
                            torch_buckets(models[1])))
            step += 1
    return first_difference, layouts


def the_plain_student(rank, world, device, verbose=True):
    """Lesson 00's student; buckets cut small so that the rebuild shows. Trains two controls
    beside it and returns their first differences from torch: a miniddp with torch's default,
    larger buckets, and torch's DDP with torch's own dividing ``allreduce_hook``."""
    student = make_model(seed=rank)  # another init on every rank: construction must broadcast
    ours = wrap(miniddp.DistributedDataParallel, student, device, bucket_cap_mb=BUCKET_CAP_MB)
    theirs = wrap(TorchDDP, student, device, bucket_cap_mb=BUCKET_CAP_MB)
    other_buckets = wrap(miniddp.DistributedDataParallel, student, device)
    dividing = wrap(TorchDDP, student, device, bucket_cap_mb=BUCKET_CAP_MB)
    dividing.register_comm_hook(None, allreduce_hook)  # grad / world_size, then a SUM
    rank0_init = make_model(seed=0).to(device)
    check(all(same_bits(p, q) for p, q in zip(ours.parameters(), rank0_init.parameters())),
          f"rank {rank}: after construction the parameters are not rank 0's")
    loader = DataLoader(shard(make_dataset(n=2048, seed=0), rank, world),
                        batch_size=BATCH_SIZE, drop_last=True)
    progress = Progress(EPOCHS * len(loader), every=max(1, EPOCHS * len(loader) // 6),
                        quiet=not verbose)
    if verbose:
        print0("every rank built its own random model; after construction all hold rank 0's\n")
        show_buckets("buckets at construction (iteration 0): one bucket, parameters in model "
                     "order", ours)
        print0("\ntraining four DDPs side by side on the same batches: miniddp, torch's, and the "
               "two controls below;\nms/step is one step of all four")
    first_difference, layouts = train_side_by_side([ours, theirs, other_buckets, dividing],
                                                   loader, device, progress=progress)
    if verbose:
        print0()
        show_buckets("buckets from step 1 on: rebuilt at step 1's forward, in the order "
                     f"gradients became ready in step 0,\ncut at bucket_cap_mb={BUCKET_CAP_MB}",
                     ours)

    rebuilt_at = next((s for s, (mine, _) in enumerate(layouts) if mine != layouts[0][0]), None)
    check(rebuilt_at == 1, f"the buckets changed at step {rebuilt_at}, torch rebuilds at step 1")
    bad = [s for s, (mine, torchs) in enumerate(layouts) if mine != torchs]
    check(not bad, f"at step {bad[:1]} miniddp's buckets {layouts[bad[0]][0] if bad else ''} "
                   f"are not torch's {layouts[bad[0]][1] if bad else ''}")
    print0("torch's C++ reducer holds the very same buckets at every step")
    step, names = first_difference[0] or (None, [])
    check(step is None, f"rank {rank}: at {world} ranks miniddp differs from torch's DDP after "
                        f"step {step}, in {', '.join(names)}")
    losses = progress.losses()
    check(losses[-1] < 0.2 * losses[0],
          f"the loss went from {losses[0]:.4f} to {losses[-1]:.4f}, not below 20% of it")
    print0(f"parameters and gradients equal to torch's DDP bit for bit after each of the "
           f"{len(layouts)} steps, at {world} ranks")
    controls = {"a miniddp with default buckets (one bucket after the rebuild)":
                (first_difference[2], "other buckets from step 1 on (at step 0 both had the one "
                 "bucket of construction): the ring adds the ranks' values in an order set by "
                 "an element's offset in its bucket and the bucket's size"),
                "torch's DDP with torch's own allreduce_hook (grad / world_size, then sum)":
                (first_difference[3], f"torch's very buckets, but it divides by {world} where "
                 f"the built-in reducer multiplies by 1 / {world}, and those round differently")}
    return controls, len(layouts), losses


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


def judge_the_controls(world: int, controls: dict, steps: int) -> None:
    """Both controls match torch at 2 ranks and neither does at 3 or more on gloo: one for the
    ring's order of additions, one for the division."""
    print0(f"\nthe controls at {world} ranks, against torch's DDP with bucket_cap_mb="
           f"{BUCKET_CAP_MB} (two buckets, grad * (1 / world_size) before the sum):")
    for name, (differs, cause) in controls.items():
        if differs is None:
            print0(f"  {name}: equal after all {steps} steps")
        else:
            step, names = differs
            print0(f"  {name}: differs from step {step} on ({', '.join(names[:3])}, ...);\n"
                   f"    why: {cause}")
    if dist.get_backend() != "gloo" or world < 2:
        return  # NCCL's sums follow other rules: nothing to claim
    if world == 2:
        print0("  at 2 ranks a + b == b + a and halving is exact: neither can show")
        check(all(d is None for d, _ in controls.values()),
              "at 2 ranks a + b == b + a and x / 2 == x * 0.5: neither control may differ, "
              f"got {controls}")
    else:
        for name, (differs, _) in controls.items():
            check(differs is not None, f"at {world} ranks {name} still matched torch's "
                                       "built-in reducer bit for bit: the control shows nothing")
        [(other_buckets, _), _] = controls.values()
        check(other_buckets[0] >= 1, f"at {world} ranks the miniddp with default buckets differed "
                                     f"at step {other_buckets[0]}, when its one bucket of "
                                     "construction was torch's: not the buckets' doing")


def on_every_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    controls, steps, losses = the_plain_student(rank, world, device)
    unused_without_the_flag(rank, device)
    with_buffers_and_unused_heads(rank, world, device)
    two_options(rank, world, device)
    judge_the_controls(world, controls, steps)
    return world, steps, losses[0], losses[-1]


def at_three_ranks():
    """The plain student again, at 3 ranks: miniddp still equal, both controls not."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    controls, steps, _ = the_plain_student(rank, world, device, verbose=False)
    two_options(rank, world, device)
    judge_the_controls(world, controls, steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world, steps, first, last = launch(on_every_rank, args.nproc)[0]
    at_three = world >= 3
    if not at_three and launched_by_torchrun():
        print0("\nthe 3-rank part needs 3 ranks: torchrun --standalone --nproc_per_node=3 "
               "lessons/08_miniddp_vs_torch_ddp.py")
    elif not at_three:
        print0("\nthe same training at 3 ranks (3 ranks forked anew): what 2 cannot show")
        launch(at_three_ranks, 3)
        at_three = True
    ok(f"miniddp's DDP equal to torch's bit for bit after each of {steps} steps on {world} ranks "
       f"(loss {first:.3f} -> {last:.4f}), same buckets, rebuilt at the same step; unused "
       "parameters and BatchNorm buffers too" + ("; at 3 ranks too, where other buckets or "
                                                 "dividing by the world size are not" * at_three))


if __name__ == "__main__":
    main()
