"""Lesson 06: overlapping communication with the backward pass, seen on a timeline.

What this adds since lesson 05: buckets made communication cheaper; this makes it start earlier.
Backward computes gradients from the last layer to the first, so the last layers' gradients are
final long before backward ends. ``miniddp.DistributedDataParallel`` puts a hook on every
parameter (a post-hook on its AccumulateGrad node, as torch's DDP does) that fires as soon as
that parameter's gradient is final, and copies it into its bucket. When a bucket is full, its
all_reduce is launched at once, asynchronously (``async_op=True``), while backward carries on
with earlier layers. When the last gradient is done, a callback queued on the autograd engine
waits for every bucket and writes the averages into ``.grad``, so ``loss.backward()`` returns
with synchronized gradients, exactly as with ``miniddp.AllReduceBucketsAfterBackward``, the rung
before this one: lesson 05's buckets, launched only once backward has ended.

Why it matters: with overlap a step costs about max(compute, communication) instead of their
sum; the DDP paper measured 22-38% shorter iterations (ResNet50 and BERT on GPUs, over NCCL and
gloo). What is left exposed is the communication of the last bucket(s) after the last gradient;
the first bucket is kept small (lesson 05's 1 MiB) so that communication starts early. Here
``bucket_cap_mb=0.5`` gives every layer its own bucket, so the picture has several.

The proof is the reducer's own record, ``ddp.reducer.timeline``: when each parameter became
ready, when each bucket was launched and finished, when backward ended. The lesson trains the
same model both ways, in turns, on the same data, and checks:

* with overlap, the first bucket was launched while gradients were still arriving, at every
  step; without it, only after the last one (an ordering of events, not a timing, so a busy
  machine cannot flip it);
* the gradients of the two are equal bit for bit at every step: the same buckets summed the
  same way, only launched at other moments.

What a 2-core CPU shows and does not: gloo runs each all_reduce on a helper thread, which must
find a core while backward keeps one busy per rank, so communication stretches out and the
step-time gain is small or nothing here. The picture shows the order of events; the speed-up
needs hardware where communication has its own engine (GPUs with NCCL's own stream). There,
the timeline's times are when the CPU launched work (CUDA is asynchronous); use a profiler to
see when the GPU ran it.

Run it:

    python lessons/06_overlap.py              # forks 2 ranks, gloo on CPU
    python lessons/06_overlap.py --nproc 3
    torchrun --standalone --nproc_per_node=2 lessons/06_overlap.py

With one GPU per rank it uses NCCL and the GPUs.

What you will see: the loss falling (the overlapped run's; the other's is the same, bit for
bit), step times and the communication left exposed after backward for each run, the timeline
of one step (per bucket: gradients arriving, all_reduce in flight) in ``runs/06_overlap.png``,
and ``OK: ...``. A few seconds.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from miniddp import AllReduceBucketsAfterBackward, DistributedDataParallel
from miniddp.data import IN_FEATURES, OUT_FEATURES, make_dataset
from miniddp.launch import launch, rank_device
from miniddp.report import Progress, check, ok, print0, save_figure

LAYERS, WIDTH = 4, 384  # each hidden weight is 576 KiB: one bucket per layer with a 0.5 MiB cap
BUCKET_CAP_MB = 0.5
STEPS = 30
LOCAL_BATCH = 32
LR = 0.1


def wide_student(device) -> nn.Module:
    """A student with enough backward work per layer for communication to hide behind."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = [nn.Linear(IN_FEATURES, WIDTH), nn.Tanh()]
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(WIDTH, OUT_FEATURES)).to(device)


def step(ddp, optimizer, x, y, device):
    """One training step, timed, with the reducer recording its timeline."""
    ddp.reducer.timeline = []
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = F.mse_loss(ddp(x), y)
    optimizer.zero_grad()
    backward_start = time.perf_counter()
    loss.backward()
    grads = [p.grad.clone() for p in ddp.parameters()]
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    events = [(kind, ident, t - backward_start) for kind, ident, t in ddp.reducer.timeline]
    return loss, grads, events, time.perf_counter() - start


def when(events, kind, ident=-1) -> float:
    return next(t for k, i, t in events if k == kind and i == ident)


def kinds(events) -> list[str]:
    return [k for k, _, _ in events]


def launched_while_gradients_arrived(events) -> bool:
    """Whether the first all_reduce started before the last gradient was ready (an ordering)."""
    order = kinds(events)
    return order.index("launch") < len(order) - 1 - order[::-1].index("ready")


def draw_timelines(timelines: dict, buckets):
    """Per bucket: a thin line while its gradients arrive, a thick bar while it is reduced."""
    def draw(ax):
        row, ticks, labels = 0, [], []
        for (name, events), colour in zip(timelines.items(), ("tab:blue", "tab:orange")):
            ready = {i: t for k, i, t in events if k == "ready"}
            for b in buckets:
                first = min(ready[i] for i in b.param_indices)
                last = max(ready[i] for i in b.param_indices)
                launched = when(events, "launch", b.index)
                done = next((t for k, i, t in events if k == "done" and i == b.index),
                            when(events, "finalized"))  # a callback records "done", maybe late
                ax.plot([1e3 * first, 1e3 * last], [row, row], color="gray", lw=1.5)
                ax.barh(row, 1e3 * (done - launched), left=1e3 * launched, height=0.6,
                        color=colour)
                ticks.append(row)
                labels.append(f"{name}: bucket {b.index}")
                row += 1
            for kind, style in (("backward_end", "--"), ("finalized", ":")):
                ax.vlines(1e3 * when(events, kind), row - len(buckets) - 0.5, row - 0.5,
                          colors=colour, linestyles=style)
            row += 1
        from matplotlib.lines import Line2D  # only here: matplotlib is optional

        ax.legend(handles=[Line2D([], [], color="gray", label="its gradients arriving"),
                           Line2D([], [], color="black", lw=6, label="its all_reduce in flight"),
                           Line2D([], [], color="black", ls="--", label="last gradient computed"),
                           Line2D([], [], color="black", ls=":", label="backward() returns")],
                  fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
        ax.set_yticks(ticks, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set(xlabel="ms since loss.backward() was called",
               title=f"one step on {dist.get_world_size()} ranks ({dist.get_backend()}), "
                     "rank 0's view")

    save_figure("06_overlap", draw)


def on_every_rank():
    rank = dist.get_rank()
    device = rank_device()
    ids = [device.index] if device.type == "cuda" else None
    runs = {"overlap": DistributedDataParallel, "after backward": AllReduceBucketsAfterBackward}
    models = {name: cls(wide_student(device), device_ids=ids, bucket_cap_mb=BUCKET_CAP_MB)
              for name, cls in runs.items()}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
                  for name, m in models.items()}
    x_all, y_all = (t.to(device) for t in make_dataset(n=LOCAL_BATCH * STEPS, seed=rank).tensors)

    progress = Progress(STEPS, every=5)
    seconds = {name: [] for name in runs}
    exposed = {name: [] for name in runs}
    timelines = {}
    for s in range(STEPS):
        x = x_all[s * LOCAL_BATCH:(s + 1) * LOCAL_BATCH]
        y = y_all[s * LOCAL_BATCH:(s + 1) * LOCAL_BATCH]
        grads = {}
        for name in runs if s % 2 == 0 else reversed(runs):  # A B B A: neither always first
            loss, grads[name], events, took = step(models[name], optimizers[name], x, y, device)
            if s >= 2:  # from step 2 on, both run on the rebuilt buckets, warmed up
                seconds[name].append(took)
                exposed[name].append(when(events, "finalized") - when(events, "backward_end"))
                timelines.setdefault(name, []).append((took, events))
            if name == "overlap":
                progress(loss)
        same = all(torch.equal(a, b) for a, b in zip(grads["overlap"], grads["after backward"]))
        check(same, f"step {s}, rank {rank}: the overlapped gradients differ from the "
                    "non-overlapped ones")
    losses = progress.losses()
    check(losses[-1] < 0.5 * losses[0],
          f"the loss went from {losses[0]:.4f} to {losses[-1]:.4f}: not below half its start")

    check(all(launched_while_gradients_arrived(e) for _, e in timelines["overlap"]),
          "with overlap, the first bucket must be launched while gradients are still arriving")
    check(not any(launched_while_gradients_arrived(e) for _, e in timelines["after backward"]),
          "the control launched during backward: the check above could not tell them apart")

    # the step of median duration, one per run, stands for the rest in the picture
    timelines = {name: sorted(steps, key=lambda x: x[0])[len(steps) // 2][1]
                 for name, steps in timelines.items()}
    overlapped, control = kinds(timelines["overlap"]), kinds(timelines["after backward"])
    buckets = models["overlap"].buckets
    print0(f"\n{len(buckets)} buckets; the first all_reduce was launched after "
           f"{overlapped[:overlapped.index('launch')].count('ready')} of "
           f"{overlapped.count('ready')} gradients with overlap, after "
           f"{control[:control.index('launch')].count('ready')} without")

    print0(f"\n{'median over steps':<18} {'step':>9} {'exposed communication':>22}")
    for name in runs:
        print0(f"{name:<18} {1e3 * statistics.median(seconds[name]):7.2f}ms "
               f"{1e3 * statistics.median(exposed[name]):20.2f}ms")
    print0("(exposed: from the last gradient computed to backward() returning. On a CPU with "
           "few cores these\ntimes are noisy and the saving can be small or none: see the "
           "docstring)")
    draw_timelines(timelines, buckets)
    return len(buckets), STEPS


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    buckets, steps = launch(on_every_rank, args.nproc)[0]
    ok(f"{buckets} buckets launched during backward, the first while gradients were still "
       f"arriving, and {steps} steps gave the non-overlapped gradients bit for bit")


if __name__ == "__main__":
    main()
