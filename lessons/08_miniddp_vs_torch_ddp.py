"""Lesson 08: the whole miniddp DistributedDataParallel, bit for bit against torch's.

What this adds since lesson 07: the proof that the pieces of lessons 03-07 together are torch's
DDP. ``miniddp.DistributedDataParallel`` trains beside ``torch.nn.parallel.
DistributedDataParallel`` on the same batches, and after every step every parameter and
gradient must be equal as raw bits (not ``allclose``, nor ``torch.equal``, for which
``0.0 == -0.0``). The bucket rebuild comes along: one bucket in model order for the first
backward, then buckets in the order the gradients arrived, cut at ``bucket_cap_mb``, compared
with the buckets inside torch's C++ reducer at every step. Part 2
(``08_miniddp_vs_torch_ddp_extras.py``) does the same for unused parameters, BatchNorm's
buffers, ``static_graph`` and ``gradient_as_bucket_view``.

Why 3 ranks are the harder test: at 2, ``a + b == b + a`` and halving is exact, so any bucket
layout and ``grad / 2`` or ``grad * (1 / 2)`` give the same bits. At 3, gloo's ring adds in an
order set by the element's offset in its bucket and the bucket's size, and
``grad / 3 != grad * (1 / 3)`` (torch's reducer multiplies by the reciprocal). Two controls
show it, one cause each: a miniddp with torch's default, larger buckets, and torch's own DDP
with its dividing ``allreduce_hook``. Both match at 2 ranks, neither at 3, while miniddp still
does. Run on 2 ranks, the lesson forks 3 more for that part (under torchrun:
``--nproc_per_node=3``).

Run it:

    python lessons/08_miniddp_vs_torch_ddp.py              # 2 ranks, gloo on CPU
    python lessons/08_miniddp_vs_torch_ddp.py --nproc 3    # the harder test
    torchrun --standalone --nproc_per_node=2 lessons/08_miniddp_vs_torch_ddp.py

With one GPU per rank it uses NCCL; the claim then rests on both DDPs calling NCCL alike.

What you should see: every rank's own random model replaced by rank 0's; the buckets before and
after the rebuild; the loss falling; "equal to torch's DDP bit for bit after each of the ...
steps"; the controls equal at 2 ranks and not at 3, each with its cause; ``OK: ...``. About 20 s.
"""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader

import miniddp
from course.data import make_dataset, make_model, shard
from course.report import Progress, check, ok, print0
from miniddp.checks.bits import same_bits
from miniddp.launch import launch, launched_by_torchrun, rank_device
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET

BATCH_SIZE = 32  # per rank
EPOCHS = 2
LR = 0.2
BUCKET_CAP_MB = 0.0005  # about 520 bytes: two buckets for lesson 00's student after the rebuild


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
    judge_the_controls(world, controls, steps)
    return world, steps, losses[0], losses[-1]


def at_three_ranks():
    """The plain student again, at 3 ranks: miniddp still equal, both controls not."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    controls, steps, _ = the_plain_student(rank, world, device, verbose=False)
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
       f"(loss {first:.3f} -> {last:.4f}), same buckets, rebuilt at the same step"
       + ("; at 3 ranks too, where other buckets or "
                                                 "dividing by the world size are not" * at_three))


if __name__ == "__main__":
    main()
