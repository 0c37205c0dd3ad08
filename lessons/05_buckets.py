"""Lesson 05: gradient buckets, and the latency-bandwidth model that says why they pay.

What this adds since lesson 04: lesson 03 all_reduced every gradient tensor on its own. DDP packs
gradients into a few flat buffers, *buckets*, and reduces each with one call. Here by hand
(``assign_by_hand``, ``all_reduce_in_buckets``), then proven equal to ``ddp.buckets``, to
torch's DDP, and to lesson 03's per-parameter version.

Why it matters: a collective on ``n`` bytes costs about ``t(n) = alpha + n * beta``; ``alpha``
(latency: waking the other ranks, handshakes, Python) is paid on every call, however small. For
P tensors and N bytes, one call each costs ``P * alpha + N * beta``, B buckets
``B * alpha + N * beta``. One bucket would be cheapest, but it can start only once the last
gradient exists (lesson 06 keeps a few for that reason).

The idea, in two short functions:

* ``assign_by_hand``, torch's rule: walk the parameters in an order; per dtype and device, add
  each to the open bucket and close it once it holds at least the limit (1 MiB for the first,
  then ``bucket_cap_mb``, 25 MiB by default; never splitting a parameter). At construction DDP
  cannot know the order gradients become ready, so iteration 0 uses one bucket in parameter
  order; the first backward records that order (last layer first, a Linear's bias before its
  weight) and the second forward rebuilds the buckets in it. (With
  ``find_unused_parameters=True`` torch never rebuilds and cuts buckets at construction, in
  model order, the list reversed.)
* ``all_reduce_in_buckets``: each bucket's gradients flattened, times ``1 / world_size``, into one
  buffer, one all_reduce, the averages copied back into ``.grad``.

The times are measured in turns (every size and strategy once per round, shuffled) and shown as
medians next to the fitted line, but never checked: load on a shared machine can bend them.
``alpha`` here is per call in a burst of calls back to back; lesson 11 measures one call after a
barrier, which costs more (it says why). The checks are what no load changes: layouts and bits.

Run it:

    python lessons/05_buckets.py              # forks 2 ranks, gloo on CPU
    python lessons/05_buckets.py --nproc 4    # more ranks than cores? watch alpha explode
    torchrun --standalone --nproc_per_node=2 lessons/05_buckets.py

What you should see: the one bucket of construction, then the rebuilt buckets (the first closing
at 1 MiB), equal to torch's; gradients by hand equal to miniddp's and torch's bit for bit; the
all_reduce time per size next to the fitted line, ``alpha``, ``beta`` and the size where they
balance; predicted and measured costs of one call per tensor, a few buckets, one bucket, ranked
alike; ``runs/05_buckets.png``; ``OK: ...``. About 20 s.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course.data import IN_FEATURES, OUT_FEATURES, make_dataset
from course.report import check, ok, print0, save_figure
from miniddp import DistributedDataParallel
from miniddp.buckets import bucket_limits
from miniddp.launch import launch, rank_device

HIDDEN_LAYERS, WIDTH = 24, 128
SIZES = [4**k for k in range(1, 11)]  # elements: 16 bytes ... 4 MiB (float32: 4 bytes each)
ROUNDS = 15
BURST = 4  # each size is timed as 4 calls in a row, as a training step makes them
MIB = 2**20


def deep_student(device) -> nn.Module:
    """The lessons' student made deep and narrow: many small tensors, as real models have."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = [nn.Linear(IN_FEATURES, WIDTH), nn.Tanh()]
        for _ in range(HIDDEN_LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(WIDTH, OUT_FEATURES)).to(device)


def show(buckets):
    for b in buckets:
        names = b.names if len(b.names) <= 4 else [*b.names[:3], "...", b.names[-1]]
        print0(f"  bucket {b.index}: {len(b.names):>2} tensors, {b.nbytes / MIB:.2f} MiB: "
               + ", ".join(names))


def assign_by_hand(params, order, first_bytes: int, cap_bytes: int) -> list[list[int]]:
    """torch's rule: per (dtype, device), fill a bucket in ``order`` until it holds at least
    the limit (``first_bytes`` for a group's first bucket, then ``cap_bytes``); never split."""
    closed, open_buckets = [], {}  # (dtype, device) -> [members, bytes, buckets closed so far]
    for i in order:
        p = params[i]
        entry = open_buckets.setdefault((p.dtype, p.device), [[], 0, 0])
        entry[0].append(i)
        entry[1] += p.numel() * p.element_size()
        if entry[1] >= (first_bytes if entry[2] == 0 else cap_bytes):
            closed.append(entry[0])
            entry[0], entry[1], entry[2] = [], 0, entry[2] + 1
    return closed + [members for members, _, _ in open_buckets.values() if members]


def at_construction(params, first_bytes: int, cap_bytes: int) -> list[list[int]]:
    """In parameter order, sorted by smallest index, then reversed: the last layers go first."""
    buckets = assign_by_hand(params, range(len(params)), first_bytes, cap_bytes)
    return list(reversed(sorted(buckets, key=min)))


def all_reduce_in_buckets(params, buckets: list[list[int]]) -> None:
    """Average ``.grad`` over the ranks with one all_reduce per bucket."""
    world = dist.get_world_size()
    for members in buckets:
        grads = [params[i].grad for i in members]
        flat = torch.cat([g.reshape(-1) for g in grads]) * (1.0 / world)  # torch's scaling
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def all_reduce_each_parameter(params) -> None:
    """Lesson 03's version: one all_reduce per gradient, then divide by the world size."""
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def ready_order(model, x, y) -> list[int]:
    """The order gradients become ready in one backward, seen by a hook on every parameter."""
    order = []
    hooks = [p.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
             for i, p in enumerate(model.parameters())]
    F.mse_loss(model(x), y).backward()
    for hook in hooks:
        hook.remove()
    return order


def by_hand_like_the_library(device, ddp, theirs, x, y):
    """The layouts and the averaged gradients by hand, against miniddp's and torch's."""
    world, params = dist.get_world_size(), list(ddp.module.parameters())
    first, cap = bucket_limits(None)
    rebuilt = assign_by_hand(params, ready_order(deep_student(device), x, y), first, cap)
    check(rebuilt == [b.param_indices for b in ddp.buckets],
          f"buckets by hand {rebuilt} differ from ddp.buckets after the rebuild")
    unused_ddp = DistributedDataParallel(deep_student(device), find_unused_parameters=True)
    built = at_construction(params, first, cap)  # with find_unused_parameters: never rebuilt
    theirs_at_construction, _ = dist._compute_bucket_assignment_by_size(params, [first, cap])
    check(built == [b.param_indices for b in unused_ddp.buckets]
          == list(reversed(theirs_at_construction)),
          f"buckets by hand at construction {built} differ from miniddp's "
          f"{[b.param_indices for b in unused_ddp.buckets]} or torch's "
          f"{list(reversed(theirs_at_construction))}")

    results = {}
    for name, model in (("miniddp", ddp), ("torch", theirs), ("by hand", None),
                        ("per parameter", None)):
        local = deep_student(device) if model is None else model
        local.zero_grad()
        F.mse_loss(local(x), y).backward()
        if name == "by hand":
            all_reduce_in_buckets(list(local.parameters()), rebuilt)
        elif name == "per parameter":
            all_reduce_each_parameter(list(local.parameters()))
        results[name] = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    for name in ("miniddp", "torch"):
        check(torch.equal(results["by hand"], results[name]),
              f"gradients averaged in buckets by hand differ from {name}'s DDP's")
    same = torch.equal(results["by hand"], results["per parameter"])
    diff = (results["by hand"] - results["per parameter"]).abs().max().item()
    print0(f"buckets by hand: the layout of ddp.buckets and torch's, before and after the "
           f"rebuild; gradients equal to miniddp's and torch's DDP bit for bit, and to one "
           f"all_reduce per parameter {'bit for bit' if same else f'to {diff:.1e}'}")
    if world == 2:  # a + b == b + a, and halving is exact: nothing left to differ
        check(same, f"at 2 ranks buckets by hand must equal lesson 03's per-parameter "
                    f"all_reduce bit for bit; they differ by {diff:.2e}")


def buckets_like_torch(device):
    """Show ``ddp.buckets`` before and after the rebuild; compare with torch's DDP's."""
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(deep_student(device), device_ids=ids)
    theirs = torch.nn.parallel.DistributedDataParallel(deep_student(device), device_ids=ids)
    print0("at construction (iteration 0): one bucket, in parameter order")
    show(ddp.buckets)
    x, y = (t.to(device) for t in make_dataset(n=32, seed=dist.get_rank()).tensors)
    built = [b.param_indices for b in ddp.buckets]
    F.mse_loss(ddp(x), y).backward()  # records the order in which gradients become ready
    check([b.param_indices for b in ddp.buckets] == built, "the buckets changed before the "
          "second forward: the order of the first backward is only complete at its end")
    F.mse_loss(ddp(x), y).backward()  # its forward rebuilds the buckets in that order
    print0("from the second forward on: rebuilt in the order gradients became ready in the "
           "first backward")
    show(ddp.buckets)
    for _ in range(3):  # torch rebuilds at the second forward too, and logs it at the third
        F.mse_loss(theirs(x), y).backward()

    logged = theirs._get_ddp_logging_data()  # what torch's reducer reports about its buckets
    torch_buckets = [[int(i) for i in b.split()]
                     for b in logged["rebuilt_per_bucket_param_indices"].split(",")]
    torch_bytes = [int(s) for s in str(logged["rebuilt_bucket_sizes"]).split(",")]
    ours = [b.param_indices for b in ddp.buckets]
    check(ours == torch_buckets, f"miniddp's buckets {ours} differ from torch's {torch_buckets}")
    check([b.nbytes for b in ddp.buckets] == torch_bytes,
          f"bucket sizes {[b.nbytes for b in ddp.buckets]} differ from torch's {torch_bytes}")
    first, params = ddp.buckets[0], list(ddp.module.parameters())
    last = params[first.param_indices[-1]]
    check(first.nbytes >= MIB > first.nbytes - last.numel() * last.element_size(),
          f"the first bucket ({first.nbytes} bytes) should close as soon as it holds 1 MiB")
    print0("the same buckets, members and sizes as torch's DistributedDataParallel builds")
    by_hand_like_the_library(device, ddp, theirs, x, y)
    return ddp


def measure(device, strategies: dict[str, list[int]]):
    """Median all_reduce time (s) of every size in SIZES and of every strategy's calls.

    Each round times every item once, in an order shuffled alike on every rank (they must make
    the same calls in the same order). The medians are averaged over the ranks, so every rank
    fits, prints and checks the very same numbers.
    """
    items = [("size", n) for n in SIZES] + [("strategy", name) for name in strategies]
    buffers = {("size", n): [torch.ones(n, device=device) for _ in range(BURST)] for n in SIZES}
    for name, numels in strategies.items():
        buffers[("strategy", name)] = [torch.ones(n, device=device) for n in numels]
    times = {item: [] for item in items}
    order = torch.Generator().manual_seed(0)
    for round_ in range(ROUNDS + 1):  # round 0 warms up
        for k in torch.randperm(len(items), generator=order).tolist():
            tensors = buffers[items[k]]
            start = time.perf_counter()
            for t in tensors:
                dist.all_reduce(t)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_ > 0:
                times[items[k]].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[item]) / len(buffers[item]) ** (kind == "size")
                            for item, kind in zip(items, (i[0] for i in items))],
                           dtype=torch.float64, device=device)
    dist.all_reduce(medians)
    medians = (medians / dist.get_world_size()).tolist()
    return medians[:len(SIZES)], dict(zip(strategies, medians[len(SIZES):]))


def fit(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least squares on *relative* errors: ``(alpha + n * beta) / t`` as close to 1 as possible.

    Plain least squares on seconds would let the 4 MiB message decide everything and leave
    ``alpha`` as noise; dividing by ``t`` makes a 4-byte message count as much as 4 MiB.
    """
    n = torch.tensor(nbytes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    a = torch.stack([torch.ones_like(n), n], dim=1) / t[:, None]
    alpha, beta = torch.linalg.lstsq(a, torch.ones_like(t)[:, None]).solution.flatten().tolist()
    return alpha, beta


def plot(nbytes, seconds, alpha, beta, strategies, measured):
    def draw(ax):
        ax.loglog(nbytes, [1e3 * s for s in seconds], "o", label="all_reduce, one call (median)")
        line = [2.0**k for k in range(4, 23)]  # 16 bytes ... 4 MiB, as measured
        ax.loglog(line, [1e3 * (alpha + n * beta) for n in line], "-",
                  label=f"fit: {1e6 * alpha:.0f} us + n / {1e-9 / beta:.2f} GB/s")
        for (name, numels), marker in zip(strategies.items(), "s^D"):
            ax.loglog([4 * sum(numels)], [1e3 * measured[name]], marker,
                      label=f"{name}: {len(numels)} call(s)")
        ax.axvline(alpha / beta, color="gray", ls=":", lw=1)
        ax.set(xlabel="message size (bytes)", ylabel="time (ms)",
               title=f"all_reduce on {dist.get_world_size()} ranks ({dist.get_backend()}): "
                     "t(n) = alpha + n beta")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)

    save_figure("05_buckets", draw)


def on_every_rank():
    device = rank_device()
    ddp = buckets_like_torch(device)
    strategies = {
        "one call per parameter": [p.numel() for p in ddp.module.parameters()],
        "DDP's buckets": [b.numel for b in ddp.buckets],
        "one bucket": [sum(p.numel() for p in ddp.module.parameters())],
    }
    seconds, measured = measure(device, strategies)
    nbytes = [4.0 * n for n in SIZES]
    alpha, beta = fit(nbytes, seconds)
    errors = [(alpha + n * beta) / t - 1 for n, t in zip(nbytes, seconds)]

    print0(f"\nall_reduce on {dist.get_world_size()} ranks, median of {ROUNDS} rounds:")
    print0(f"{'bytes':>9} {'measured':>10} {'fitted':>10} {'error':>7}")
    for n, t, e in zip(nbytes, seconds, errors):
        print0(f"{n:9.0f} {1e3 * t:8.3f}ms {1e3 * (alpha + n * beta):8.3f}ms {100 * e:+6.0f}%")
    typical = statistics.median(abs(e) for e in errors)
    print0(f"alpha = {1e6 * alpha:.1f} us per call, beta = {1e3 * beta * MIB:.3f} ms per MiB "
           f"({1e-9 / beta:.2f} GB/s); they balance at {alpha / beta / 1024:.0f} KiB. "
           f"Typical error of the line: {100 * typical:.0f}%")
    if alpha <= 0 or beta <= 0 or typical >= 0.5:  # shown, not checked: load is nobody's fault
        print0(f"this fit is poor (alpha {alpha:.1e} s, beta {beta:.1e} s/byte, typical error "
               f"{100 * typical:.0f}%): other programs took the cores while some sizes were "
               "timed.\nThe model still holds; its numbers here do not. Run again on a quieter "
               "machine to see a clean line")

    print0(f"\n{'':<23} {'calls':>5} {'MiB':>6} {'predicted':>10} {'measured':>10} "
           f"{'ratio':>6}")
    for name, numels in strategies.items():
        predicted = len(numels) * alpha + 4 * sum(numels) * beta
        print0(f"{name:<23} {len(numels):>5} {4 * sum(numels) / MIB:6.2f} "
               f"{1e3 * predicted:8.2f}ms {1e3 * measured[name]:8.2f}ms "
               f"{measured[name] / predicted:5.1f}x")
    per_param, buckets = measured["one call per parameter"], measured["DDP's buckets"]
    calls = len(strategies["one call per parameter"])
    print0(f"the same {4 * sum(strategies['one bucket']) / MIB:.2f} MiB cost "
           f"{per_param / buckets:.1f}x as much in {calls} calls as in {len(ddp.buckets)} "
           f"buckets: each call pays alpha"
           + ("" if per_param > buckets else " (not on this run: the load of other programs "
              "outweighed alpha; the timings are shown, not checked)"))
    plot(nbytes, seconds, alpha, beta, strategies, measured)
    return alpha, beta, per_param / buckets


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    alpha, beta, ratio = launch(on_every_rank, args.nproc)[0]
    ok(f"buckets by hand match the library's and torch's, layouts and gradients bit for bit; "
       f"measured here: all_reduce costs {1e6 * alpha:.0f} us + {1e3 * beta * MIB:.2f} ms/MiB, "
       f"and buckets made the same gradients {ratio:.1f}x cheaper than one call per parameter")


if __name__ == "__main__":
    main()
