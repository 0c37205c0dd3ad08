"""Lesson 13: communication hooks: what goes over the wire, and what compressing it costs.

What this adds since lesson 12: control over the all_reduce itself. Until now every bucket held
``grad * (1 / world_size)`` in fp32 and was summed across ranks as it was: 4 bytes per gradient per
step. ``ddp.register_comm_hook(state, hook)`` hands each full bucket to ``hook(state, bucket)``
instead, and the hook decides what to send. The reducer then copies gradients in *unscaled*
(averaging becomes the hook's job), and at the end of backward writes back whatever tensor the
hook's future holds. A hook is a few lines:

    def mean(state, bucket):                      # torch's allreduce_hook, written out
        buffer = bucket.buffer().div_(world_size) # the bucket's flat gradients, unscaled
        sent = dist.all_reduce(buffer, async_op=True).get_future()
        return sent.then(lambda done: buffer)     # backward waits for this at its end

The idea that pays is compression: cast the bucket to fp16 before sending it, and back after.
Half the bytes cross the network, which is what limits DDP on many machines with slow links;
the price is fp16's rounding (11 significant bits), applied to every gradient, every step.

What this lesson proves, on every rank:

1. the two hooks written here send 4 and 2 bytes per gradient (counted in their ``state``) and
   give torch's DDP bits exactly: ``mean`` on miniddp equals torch's DDP with torch's
   ``allreduce_hook``, ``fp16_mean`` equals it with ``fp16_compress_hook``, after every step
   (and ``mean`` is hook-less DDP to the last bit only where the world size is a power of two:
   it divides by 3 at 3 ranks, where the reducer multiplies by 1/3, and those round differently;
   at 2 ranks halving is exact either way);
2. what fp16 costs: the averaged gradients differ from the exact fp32 average by about 3e-4
   (relative), bf16's by about 3e-3, and training still converges to a held-out loss close to
   the fp32 run's (bf16 with miniddp's own ``miniddp.options.comm_hooks.bf16_compress``: torch's
   DDP accepts torch's bf16 hooks only on a CUDA build with NCCL, or XPU with XCCL, and miniddp
   refuses them likewise: both refusals are shown);
3. torch's own hook functions run on miniddp unchanged and give torch's DDP bits:
   ``allreduce_hook``, ``fp16_compress_hook``, ``fp16_compress_wrapper``, PowerSGD (one bucket:
   on gloo, torch's DDP itself aborts PowerSGD with several buckets in flight) and ``noop_hook``,
   which sends nothing and lets the replicas drift apart: it only measures what communication
   costs.

Run it:

    python lessons/13_communication_hooks.py                  # 2 ranks, gloo on CPU
    python lessons/13_communication_hooks.py --nproc 3
    torchrun --standalone --nproc_per_node=2 lessons/13_communication_hooks.py

What you will see: the loss falling under fp16 compression, bytes sent per step with each hook
(half with fp16), "equal bit for bit" for each pair, the gradient error of fp16 and bf16 next to
the exact average, the held-out losses side by side, torch's hooks each equal on miniddp, the
noop replicas apart, and ``OK: ...``. About 15 s.
"""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader

import miniddp
from course.data import make_dataset, make_model, shard
from course.report import Progress, check, ok, print0
from miniddp.checks.bits import same_bits
from miniddp.launch import launch, rank_device
from miniddp.options import comm_hooks

BATCH_SIZE = 32  # per rank
EPOCHS = 2
LR = 0.2
# How far a compressed run may end from the fp32 run, as a ratio of held-out losses. Measured:
# within a few percent; a run that stopped learning is off by 10x or more.
LOSS_RATIO = 1.5


# ----- two hooks, written out: the state is a list that logs the bytes each sends -----

def mean(sent: list, bucket):
    """Average the bucket in fp32: divide, then sum across ranks (torch's allreduce_hook)."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    sent.append(buffer.nbytes)
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: buffer)


def fp16_mean(sent: list, bucket):
    """Average the bucket in fp16 (torch's fp16_compress_hook): cast, divide, sum, cast back."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16).div_(dist.get_world_size())
    sent.append(compressed.nbytes)
    return dist.all_reduce(compressed, async_op=True).get_future().then(
        lambda done: buffer.copy_(compressed))


# ----- training with a hook, on miniddp and (when given one) on torch's DDP beside it -----

def train(rank, world, device, our_hook, torch_hook=None, verbose=False, epochs=EPOCHS):
    """Train lesson 00's student; ``our_hook`` and ``torch_hook`` are ``(state, hook)``."""
    wrappers = [miniddp.DistributedDataParallel] + ([TorchDDP] if torch_hook else [])
    models = [cls(copy.deepcopy(make_model(seed=0)).to(device)) for cls in wrappers]
    for model, (state, hook) in zip(models, [our_hook, torch_hook]):
        if hook is not None:
            model.register_comm_hook(state, hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    loader = DataLoader(shard(make_dataset(n=2048, seed=0), rank, world),
                        batch_size=BATCH_SIZE, drop_last=True)
    progress = Progress(epochs * len(loader), every=epochs * len(loader) // 4,
                        quiet=not verbose)
    first_difference, step = None, 0
    for _epoch in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            for model, optimizer in zip(models, optimizers):
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                if model is models[0]:
                    progress(loss)
            if torch_hook and first_difference is None and not all(
                    same_bits(a, b) for a, b in zip(*(m.parameters() for m in models))):
                first_difference = step
            step += 1
    held_out_x, held_out_y = (t.to(device) for t in make_dataset(n=1024, seed=1).tensors)
    with torch.no_grad():
        held_out = F.mse_loss(models[0](held_out_x), held_out_y).item()
    return {"losses": progress.losses(), "first_difference": first_difference, "steps": step,
            "held_out": held_out, "model": models[0].module}


def averaged_gradients(rank, device, hook):
    """The gradients after one synchronized backward from the same weights and batch."""
    ddp = miniddp.DistributedDataParallel(make_model(seed=0).to(device))
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    x, y = (t[rank::dist.get_world_size()][:BATCH_SIZE].to(device)
            for t in make_dataset(n=2048, seed=0).tensors)
    F.mse_loss(ddp(x), y).backward()
    return torch.cat([p.grad.flatten() for p in ddp.parameters()])


def sums_bf16() -> bool:
    """Whether the backend can all_reduce bf16 (gloo could not before about torch 2.2)."""
    try:
        dist.all_reduce(torch.ones(1, dtype=torch.bfloat16, device=rank_device()))
    except RuntimeError:  # raised on every rank alike, before anything is sent
        return False
    return True


def relative_error(approx, exact) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


def refusal_of_torchs_bf16_hook(wrapper, device) -> str | None:
    """Why ``wrapper`` refuses torch's ``bf16_compress_hook`` (its first words), or None."""
    try:
        wrapper(make_model(seed=0).to(device)).register_comm_hook(
            None, torch_hooks.bf16_compress_hook)
    except TypeError as refusal:
        return f"refused, TypeError: {str(refusal).split('(')[0].strip()}"
    return None


def torch_hooks_on_miniddp(rank, world, device):
    """Each of torch's hooks on miniddp and on torch's DDP, side by side for one epoch."""
    def powersgd_pair():
        return [(powersgd.PowerSGDState(None, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2), powersgd.powerSGD_hook)
                for _ in range(2)]

    pairs = {
        "allreduce_hook": [(None, torch_hooks.allreduce_hook)] * 2,
        "fp16_compress_hook": [(None, torch_hooks.fp16_compress_hook)] * 2,
        "fp16_compress_wrapper(allreduce_hook)": [
            (None, torch_hooks.fp16_compress_wrapper(torch_hooks.allreduce_hook))] * 2,
        "powerSGD_hook": powersgd_pair(),
        "noop_hook": [(None, debugging_hooks.noop_hook)] * 2,
    }
    results = {}
    for name, (ours, theirs) in pairs.items():
        results[name] = r = train(rank, world, device, ours, theirs, epochs=1)
        gathered = [None] * world
        dist.all_gather_object(gathered, [p.detach().cpu() for p in r["model"].parameters()])
        replicas_equal = all(same_bits(a, b) for other in gathered[1:]
                             for a, b in zip(gathered[0], other))
        print0(f"  {name:<38} equal to torch's DDP bit for bit: "
               f"{r['first_difference'] is None}; replicas on every rank equal: {replicas_equal}")
        check(r["first_difference"] is None, f"rank {rank}: torch's {name} on miniddp differs "
                                             f"from torch's DDP after step {r['first_difference']}")
        check(replicas_equal == (name != "noop_hook"),
              f"{name}: replicas equal across ranks is {replicas_equal}; expected "
              f"{name != 'noop_hook'} (noop sends nothing, every other hook averages)")
    return results


def on_every_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()

    print0("1. Two hooks written out, each next to torch's DDP with torch's hook:")
    runs, sent = {}, {}
    for name, ours, theirs in [("fp32 mean", mean, torch_hooks.allreduce_hook),
                               ("fp16 mean", fp16_mean, torch_hooks.fp16_compress_hook)]:
        log = []
        if name == "fp16 mean":
            print0(f"  {name}, training (ms/step: miniddp's and torch's DDP, a step each):")
        runs[name] = r = train(rank, world, device, (log, ours), (None, theirs),
                               verbose=name == "fp16 mean")
        sent[name] = sum(log) // r["steps"]
        check(r["first_difference"] is None, f"rank {rank}: {name} on miniddp differs from "
                                             f"torch's DDP after step {r['first_difference']}")
        print0(f"  {name}: {sent[name]} bytes handed to all_reduce per rank per step (a ring "
               f"sends 2(W-1)/W of that, lesson 01), equal to torch's DDP bit for bit after "
               f"each of {r['steps']} steps")
    numel = sum(p.numel() for p in make_model(seed=0).parameters())
    check(sent["fp32 mean"] == 4 * numel and sent["fp16 mean"] == 2 * numel,
          f"expected {4 * numel} and {2 * numel} bytes per step, got {sent}")
    losses = runs["fp16 mean"]["losses"]
    check(losses[-1] < 0.2 * losses[0], f"the fp16 run's loss went from {losses[0]:.4f} to "
                                        f"{losses[-1]:.4f}, not below 20% of it")

    print0("\n2. What compression costs in bits (one step, same weights and batch):")
    refusals = {name: refusal_of_torchs_bf16_hook(cls, device)
                for name, cls in [("torch's DDP", TorchDDP),
                                  ("miniddp", miniddp.DistributedDataParallel)]}
    for name, refusal in refusals.items():
        print0(f"  torch's bf16_compress_hook on {name}: {refusal or 'accepted'}")
    check((refusals["miniddp"] is None) == (refusals["torch's DDP"] is None),
          f"torch's bf16_compress_hook: miniddp and torch's DDP disagree on it: {refusals}")
    compressions = [("fp16", comm_hooks.fp16_compress)]
    if sums_bf16():
        compressions.append(("bf16", comm_hooks.bf16_compress))
    else:
        print0(f"  bf16 skipped: {dist.get_backend()} cannot all_reduce bf16 on torch "
               f"{torch.__version__}")
    exact = averaged_gradients(rank, device, None)
    errors = {name: relative_error(averaged_gradients(rank, device, hook), exact)
              for name, hook in compressions}
    for name, error in errors.items():
        print0(f"  {name} compression: averaged gradients {error:.1e} (relative) from the exact "
               "fp32 average")
    check(0 < errors["fp16"] < 1e-3, f"fp16's error {errors['fp16']:.1e}: expected some, "
                                     "below 1e-3 (fp16 keeps 11 significant bits)")
    if "bf16" in errors:
        check(errors["fp16"] < errors["bf16"] < 1e-2,
              f"bf16's error {errors['bf16']:.1e}: expected above fp16's (bf16 keeps 8 "
              "significant bits) and below 1e-2")
        runs["bf16 mean (comm_hooks.bf16_compress)"] = train(rank, world, device,
                                                    (None, comm_hooks.bf16_compress))
    reference = train(rank, world, device, (None, None))
    print0(f"  after training, held-out loss without a hook {reference['held_out']:.6f}; "
           "with each hook, and its parameters' distance (relative) from that run's:")
    width = max(len(name) for name in runs)
    for name, r in runs.items():
        ratio = r["held_out"] / reference["held_out"]
        drift = max((a - b).norm() / b.norm() for a, b in zip(
            r["model"].parameters(), reference["model"].parameters())).item()
        print0(f"    {name:<{width}}  held-out loss {r['held_out']:.6f}, "
               f"parameters {drift:.1e} away")
        check(1 / LOSS_RATIO < ratio < LOSS_RATIO,
              f"{name}: held-out loss {ratio:.2f}x the hook-less run's, outside "
              f"[1/{LOSS_RATIO}, {LOSS_RATIO}]")
        if name != "fp32 mean":
            check(drift > 0, f"{name}: compression left no trace in the parameters; was the "
                             "hook used at all?")
    # x / W and x * (1 / W) are the same float for every x only when W is a power of two
    exact_scale = world & (world - 1) == 0
    pairs = list(zip(runs["fp32 mean"]["model"].parameters(), reference["model"].parameters()))
    same = all(same_bits(a, b) for a, b in pairs)
    largest = max((a - b).abs().max().item() for a, b in pairs)
    check(same == exact_scale,
          f"at {world} ranks fp32 mean ended {'bit for bit equal to' if same else 'apart from'} "
          f"the hook-less run (largest difference {largest:.1e}); expected "
          f"{'equal' if exact_scale else 'apart'}: dividing by {world} and multiplying by "
          f"1/{world} round {'alike' if exact_scale else 'differently'}")
    print0(f"  fp32 mean and no hook at {world} ranks: " + (
        f"equal bit for bit, since the hook divides by {world}, the reducer multiplies by "
        f"1/{world}, and at a power of two those are the same float" if same else
        f"apart (largest difference {largest:.1e}), since the hook divides by {world}, the reducer "
        f"multiplies by 1/{world}, and those round differently"))

    print0("\n3. torch's own hook functions, unchanged, on miniddp and on torch's DDP:")
    torch_runs = torch_hooks_on_miniddp(rank, world, device)
    return world, errors, len(torch_runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world, errors, hooks = launch(on_every_rank, args.nproc)[0]
    bf16 = f" and {errors['bf16']:.0e} (bf16)" if "bf16" in errors else ""
    ok(f"on {world} ranks: fp16 compression sent half the bytes, the loss fell, gradients "
       f"{errors['fp16']:.0e} (fp16){bf16} from exact; the lesson's "
       f"hooks and {hooks} of torch's equal to torch's DDP bit for bit after every step")


if __name__ == "__main__":
    main()
