"""Lesson 10: mixed precision with DDP: autocast, a gradient scaler for fp16, fp32 gradients.

What this adds since lesson 09: cheaper arithmetic. ``torch.autocast`` runs the operations that
gain from it (matrix products, convolutions) in a 16-bit float and keeps the rest in fp32; the
parameters, their ``.grad`` and the optimizer stay fp32. On GPUs with tensor cores that is
several times faster, and saved activations take half the memory. DDP needs no change: ``.grad``
is fp32 (the backward of autocast's cast returns the parameter's dtype), so the buckets are fp32
and an all_reduce sends as many bytes as without autocast (sending fewer is lesson 13's hooks).

The two 16-bit formats differ where it matters:

* **bf16** keeps fp32's 8 exponent bits (its range, down to 1e-38) with 8 bits of mantissa:
  gradients do not underflow, so it needs nothing but the ``autocast`` block.
* **fp16** has 11 bits of mantissa but 5 of exponent: below 6.1e-5 it keeps ever fewer bits, and
  a gradient of 1e-8 rounds to zero. ``torch.amp.GradScaler`` multiplies the loss by a large
  scale (65536 by default; 2**20 below, so that a skipped step shows), divides the fp32 ``.grad``
  by it before the step, and skips the step (halving the scale) on inf or NaN. Under DDP every
  rank sees the same averaged gradients, so every rank decides alike without a collective.

What the lesson proves on every rank: for a small loss (1e-5 times this task's, as a loss
averaged over many tokens), fp16 alone rounds about a third of the gradient elements to zero and
the rest are a quarter off, while with the scaler none is zero (so removing the scaler fails the
lesson) and bf16 needs none; the loss falls under bf16 (and fp16); miniddp's and torch's DDP under
the same autocast stay equal bit for bit after every step; buckets and gradients are fp32; the
bf16 run ends close to an fp32 run (close, not equal: bf16 rounds at the third digit). fp16 on
the CPU needs torch >= 2.3 (``torch.amp.GradScaler``); before, it is skipped with a note.

Run it:

    python lessons/10_mixed_precision.py                      # 2 ranks, gloo on CPU
    python lessons/10_mixed_precision.py --nproc 3
    torchrun --standalone --nproc_per_node=2 lessons/10_mixed_precision.py

With one GPU per rank it uses NCCL, fp16 with its scaler, and bf16 where the GPU has it.

What you should see: 1e-8 in fp16 and bf16; the gradient elements rounded to zero and the error
in fp16 without and with the scaler and in bf16; the bf16 loss falling; the dtypes of output,
gradients and buckets; "equal bit for bit" for each precision; the fp16 run's scale and skipped
steps; held-out losses of fp32, bf16 and fp16 side by side; ``OK: ...``. About 20 s.
"""

import argparse
import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader

import miniddp
from course.data import make_dataset, make_model, shard
from course.report import Progress, check, ok, print0
from miniddp.checks.bits import same_bits
from miniddp.launch import launch, rank_device

BATCH_SIZE = 32  # per rank
EPOCHS = 2
LR = 0.2
# How far the bf16 run may end from the fp32 run, as a ratio of held-out losses. Measured: within
# a few percent. A run that did not learn, or learnt something else, is off by a factor of 10+.
BF16_LOSS_RATIO = 1.5
# torch's default first scale is 2**16; starting higher makes the scaler's back-off visible: the
# first steps overflow fp16 (max 65504), are skipped, and the scale halves until they fit.
INIT_SCALE = 2.0**20
# A loss this much smaller than the task's has gradients around 1e-8, below fp16's smallest
# number (6e-8): what a loss averaged over many more elements, or late in training, looks like.
SMALL_LOSS = 1e-5


def wrap(ddp_class, model, device):
    """Wrap a copy of ``model`` in a DDP class (miniddp's or torch's), one GPU per rank on GPU."""
    ids = [device.index] if device.type == "cuda" else None
    return ddp_class(copy.deepcopy(model).to(device), device_ids=ids)


def grad_scaler(device):
    """A GradScaler for ``device``, or None where this torch has none (CPU before torch 2.3)."""
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device.type, init_scale=INIT_SCALE)
    if device.type == "cuda":
        return torch.cuda.amp.GradScaler(init_scale=INIT_SCALE)
    return None


def held_out_loss(model, device) -> float:
    """Mean squared error on samples never trained on, computed in fp32."""
    x, y = (t.to(device) for t in make_dataset(n=1024, seed=1).tensors)
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def train(rank, world, device, dtype, side_by_side=True, verbose=False):
    """Train lesson 00's student with miniddp's DDP, and torch's DDP next to it, under
    ``autocast(dtype)`` (fp32 when ``dtype`` is None). Returns what the lesson checks."""
    wrappers = [miniddp.DistributedDataParallel] + ([TorchDDP] if side_by_side else [])
    models = [wrap(cls, make_model(seed=0), device) for cls in wrappers]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    scalers = [grad_scaler(device) if dtype == torch.float16 else None for _ in models]
    loader = DataLoader(shard(make_dataset(n=2048, seed=0), rank, world),
                        batch_size=BATCH_SIZE, drop_last=True)
    progress = Progress(EPOCHS * len(loader), every=max(1, EPOCHS * len(loader) // 6),
                        quiet=not verbose)
    first_difference, skipped, step = None, 0, 0
    for _epoch in range(EPOCHS):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            for model, optimizer, scaler in zip(models, optimizers, scalers):
                optimizer.zero_grad()
                with torch.autocast(device.type, dtype=dtype) if dtype else nullcontext():
                    out = model(x)  # products in dtype; parameters stay fp32
                loss = F.mse_loss(out.float(), y)  # the loss in fp32
                if scaler is None:
                    loss.backward()
                    optimizer.step()
                else:
                    scale = scaler.get_scale()
                    scaler.scale(loss).backward()  # DDP averages the scaled fp32 gradients
                    scaler.step(optimizer)  # unscales .grad; skips the step on inf/NaN
                    scaler.update()  # halves the scale after a skip
                    if model is models[0] and scaler.get_scale() < scale:
                        skipped += 1
                if model is models[0]:
                    progress(loss)
                    out_dtype = out.dtype
            if side_by_side and first_difference is None and not all(
                    same_bits(a, b) for a, b in zip(*(m.parameters() for m in models))):
                first_difference = step
            step += 1
    ours = models[0]
    return {"losses": progress.losses(), "held_out": held_out_loss(ours.module, device),
            "first_difference": first_difference, "steps": step, "out_dtype": out_dtype,
            "grad_dtypes": {p.grad.dtype for p in ours.parameters()},
            "bucket_dtypes": {b.dtype for b in ours.buckets}, "skipped": skipped,
            "scale": scalers[0].get_scale() if scalers[0] else None, "model": ours.module}


def why_fp16_needs_a_scaler():
    """A gradient of 1e-8 in each format, and in fp16 after scaling by 65536."""
    tiny = torch.tensor(1e-8)
    fp16, bf16 = tiny.half().item(), tiny.bfloat16().item()
    scaled = (tiny * 65536).half()
    print0(f"a gradient of 1e-8 stored in fp16: {fp16:g}; in bf16: {bf16:.4g}; in fp16 after "
           f"scaling by 65536: {scaled.item():.4g} (= {scaled.float().item() / 65536:.4g} "
           "once unscaled in fp32)")
    check(fp16 == 0 and bf16 > 0 and scaled.item() > 0,
          f"expected fp16 to round 1e-8 to zero and bf16 and scaled fp16 to keep it; got "
          f"{fp16}, {bf16}, {scaled.item()}")


def gradients_rounded_to_zero(rank, world, device, formats):
    """One backward of a small loss through miniddp's DDP, in fp32 and in each 16-bit format of
    ``formats`` (fp16 also with a GradScaler): how many gradient elements round to zero where fp32
    has a value, and how far the gradients are from fp32's (relative error, all elements)."""
    model = make_model(seed=0)
    x, y = (t.to(device) for t in make_dataset(n=BATCH_SIZE * world, seed=3).tensors)
    x, y = x[rank::world], y[rank::world]
    cases = [("fp32", None, False), ("fp16", torch.float16, False),
             ("fp16 + GradScaler", torch.float16, True)]
    if torch.bfloat16 in formats:
        cases.append(("bf16", torch.bfloat16, False))
    grads = {}
    for name, dtype, use_scaler in cases:
        ddp = wrap(miniddp.DistributedDataParallel, model, device)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
        scaler = grad_scaler(device) if use_scaler else None
        with torch.autocast(device.type, dtype=dtype) if dtype else nullcontext():
            out = ddp(x)
        loss = SMALL_LOSS * F.mse_loss(out.float(), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)  # .grad / scale, in fp32, as scaler.step would
        grads[name] = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    reference = grads.pop("fp32")
    zeros = {name: ((g == 0) & (reference != 0)).sum().item() for name, g in grads.items()}
    errors = {name: relative_error(g, reference) for name, g in grads.items()}
    survivors = {name: relative_error(g[g != 0], reference[g != 0]) for name, g in grads.items()}
    print0(f"one backward of a loss {SMALL_LOSS:g} times this task's (gradients near 1e-8), "
           f"{reference.numel()} gradient elements, averaged by miniddp's DDP, against fp32:")
    for name in grads:
        share = 100 * zeros[name] / reference.numel()
        print0(f"  {name:<18} {zeros[name]:>4} rounded to zero ({share:>2.0f}%) where fp32 has a "
               f"value; relative error {errors[name]:.1e} ({survivors[name]:.1e} on the rest)")
    unscaled, scaled = zeros["fp16"], zeros["fp16 + GradScaler"]
    check(unscaled > 0, f"fp16 kept every gradient of a loss {SMALL_LOSS:g} times smaller: "
                        "nothing for the scaler to save here")
    check(10 * scaled < unscaled,
          f"with the GradScaler {scaled} of {reference.numel()} gradients still rounded to zero "
          f"in fp16 (without it {unscaled}): the scaler did not lift them into fp16's range")
    check(survivors["fp16"] > 10 * survivors["fp16 + GradScaler"],
          f"fp16's gradients not rounded to zero are {survivors['fp16']:.1e} from fp32's "
          f"without the scaler and {survivors['fp16 + GradScaler']:.1e} with it: the scaler did "
          "not keep their digits")
    if "bf16" in grads:
        check(10 * zeros["bf16"] < unscaled and errors["bf16"] < errors["fp16"] / 10,
              f"bf16 rounded {zeros['bf16']} gradients to zero, {errors['bf16']:.1e} from fp32's"
              f" (fp16 without a scaler: {unscaled}, {errors['fp16']:.1e}): bf16's range should "
              "keep them without a scaler")
    return zeros, errors


def relative_error(approx, exact) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


def available_precisions(device):
    """The 16-bit formats this device and this torch can train with, and notes on the rest."""
    runs, notes = [], []
    if device.type == "cpu" or torch.cuda.is_bf16_supported():
        runs.append(("bf16", torch.bfloat16))
    else:
        notes.append("bf16 skipped: this GPU does not support it")
    if grad_scaler(device) is not None:
        runs.append(("fp16", torch.float16))
    else:
        notes.append(f"fp16 skipped: torch {torch.__version__} has no GradScaler for the CPU "
                     "(torch.amp.GradScaler('cpu') arrived in torch 2.3); on a GPU it runs")
    return runs, notes


def on_every_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    why_fp16_needs_a_scaler()
    runs, notes = available_precisions(device)
    if ("fp16", torch.float16) in runs:
        gradients_rounded_to_zero(rank, world, device, [dtype for _, dtype in runs])
    reference = train(rank, world, device, None, side_by_side=False)
    results = {}
    for name, dtype in runs:
        print0(f"\n{name} autocast on {device.type}, miniddp's DDP and torch's DDP side by side"
               + (" (ms/step: one step of both):" if not results else ":"))
        r = results[name] = train(rank, world, device, dtype, verbose=not results)
        print0(f"  output {r['out_dtype']}, gradients {sorted(map(str, r['grad_dtypes']))}, "
               f"buckets {sorted(map(str, r['bucket_dtypes']))}")
        if r["scale"] is not None:
            everyone = [None] * world
            dist.all_gather_object(everyone, (r["skipped"], r["scale"]))
            print0(f"  GradScaler from {INIT_SCALE:.0f}: {r['skipped']} step(s) skipped for "
                   f"inf/NaN gradients, scale now {r['scale']:.0f}, on every rank alike\n"
                   "  (it starts at 2**20, above torch's default 2**16, so that a back-off shows)")
            check(len(set(everyone)) == 1, f"the ranks' scalers disagree (skipped steps, scale "
                                           f"by rank: {everyone}): the ranks' models diverged")
        check(r["out_dtype"] == dtype, f"{name}: the output is {r['out_dtype']}, expected "
                                       f"{dtype}: autocast did not apply")
        check(r["grad_dtypes"] == {torch.float32} and r["bucket_dtypes"] == {torch.float32},
              f"{name}: gradients {r['grad_dtypes']} and buckets {r['bucket_dtypes']} should "
              "be fp32")
        check(r["first_difference"] is None, f"rank {rank}, {name}: miniddp differs from torch's "
                                             f"DDP after step {r['first_difference']}")
        losses = r["losses"]
        check(losses[-1] < 0.2 * losses[0], f"{name}: the loss went from {losses[0]:.4f} to "
                                            f"{losses[-1]:.4f}, not below 20% of it")
        print0(f"  equal to torch's DDP bit for bit after each of the {r['steps']} steps; "
               f"loss {losses[0]:.3f} -> {losses[-1]:.4f}")
    for note in notes:
        print0(f"\n{note}")

    print0(f"\nheld-out loss after training: fp32 {reference['held_out']:.5f}" + "".join(
        f", {name} {r['held_out']:.5f}" for name, r in results.items()))
    if "bf16" in results:
        ratio = results["bf16"]["held_out"] / reference["held_out"]
        drift = max((a - b).norm() / b.norm() for a, b in zip(
            results["bf16"]["model"].parameters(), reference["model"].parameters())).item()
        print0(f"bf16 ends at {ratio:.3f}x the fp32 run's held-out loss; its parameters are "
               f"{100 * drift:.1f}% (relative) from the fp32 run's")
        check(1 / BF16_LOSS_RATIO < ratio < BF16_LOSS_RATIO,
              f"the bf16 run's held-out loss is {ratio:.2f}x the fp32 run's, outside "
              f"[1/{BF16_LOSS_RATIO}, {BF16_LOSS_RATIO}]")
    return world, list(results), results[runs[0][0]]["steps"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world, precisions, steps = launch(on_every_rank, args.nproc)[0]
    ok(f"{' and '.join(precisions)} autocast on {world} ranks: the loss fell, miniddp equal to "
       f"torch's DDP bit for bit after each of {steps} steps, fp32 gradients and buckets"
       + (", bf16 close to fp32" if "bf16" in precisions else ""))


if __name__ == "__main__":
    main()
