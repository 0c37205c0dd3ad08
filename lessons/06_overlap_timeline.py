"""Lesson 06, part 2: the library's reducer overlaps, seen on its own timeline.

What this adds since part 1 (``06_overlap.py``, whose model and cap it imports): the proof
that ``miniddp.DistributedDataParallel`` really communicates while backward still computes,
read from the reducer's own record, ``ddp.reducer.timeline`` (when each parameter became ready,
when each bucket was launched and finished, when backward ended). It trains the same model with
the library's DDP (overlap) and with ``AllReduceBucketsAfterBackward`` (the same buckets,
launched once backward has ended), in turns, on the same data, and checks:

* with overlap, gradients become ready while an all_reduce is in flight (after its launch,
  before gloo's thread records it done); never without. In the timed steps this happens by
  chance and is shown; it is checked in steps where every rank but 0 starts backward late: an
  all_reduce needs every rank, so rank 0's first one cannot finish before they join, and if it
  was launched during backward the next gradients must arrive while it is in flight, however
  loaded the machine. A reducer that waits right after each launch, or launches after
  backward, fails it;
* the two give the same gradients bit for bit at every step: the same buckets, summed the same
  way, launched at other moments.

What a 2-core CPU shows and does not: gloo's helper thread competes with backward for the cores,
so the step-time gain is small or none here; the picture shows the order of events, not a
speed-up. That needs a GPU, where NCCL has its own stream (and where the timeline records when
the CPU launched work: use a profiler to see when the GPU ran it).

Run it:

    python lessons/06_overlap_timeline.py              # forks 2 ranks, gloo on CPU
    torchrun --standalone --nproc_per_node=2 lessons/06_overlap_timeline.py

What you should see: the loss falling with each run's milliseconds per step; how often
gradients became ready while an all_reduce was in flight, in the timed and in the staggered
steps; median step times and exposed communication; ``runs/06_overlap.png`` (per bucket: its
gradients arriving, its all_reduce in flight); ``OK: ...``. About 20 s.

Every rank in one picture: ``runs/06_overlap.json``, beside the PNG, is the last staggered step
of every rank as a Chrome trace (``miniddp.checks.chrome_trace``). Open it at
https://ui.perfetto.dev ("Open trace file") or in Chrome at chrome://tracing ("Load"): a process
per rank, each with a ``backward`` track (a mark per gradient ready, the end of backward, each
bucket waited for) and ``all_reduce`` tracks (each bucket from launch to done). Rank 0's first
all_reduce lasts until the late ranks join it.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.data import make_dataset
from course.report import check, mean_over_ranks, ok, print0, runs_dir, save_figure
from course.tools import load_lesson
from miniddp import AllReduceBucketsAfterBackward, DistributedDataParallel
from miniddp.checks.chrome_trace import save_chrome_trace
from miniddp.launch import launch, rank_device

part1 = load_lesson("06_overlap")
wide_student, BUCKET_CAP_MB, LOCAL_BATCH, LR = (part1.wide_student, part1.BUCKET_CAP_MB,
                                                part1.LOCAL_BATCH, part1.LR)
STEPS = 30
STAGGERED_STEPS = 3
STAGGER_S = 0.2  # seconds: rank 0's backward of this model takes milliseconds


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


def ready_while_in_flight(events) -> int:
    """How many gradients became ready while some all_reduce was in flight: after its launch
    and before gloo's thread recorded it done. 0 when communication never overlapped backward
    (launched after backward, or waited for right after each launch)."""
    launched = {i: t for k, i, t in events if k == "launch"}
    done = {i: t for k, i, t in events if k == "done"}
    return sum(any(launched[b] < t < done[b] for b in launched)
               for k, _, t in events if k == "ready")


def on_any_rank(counts: list[int]) -> list[int]:
    """The largest of every rank's counts, step by step: the rank that launched a bucket first
    sees its gradients arrive while it waits; the last to launch may find the all_reduce done
    at once."""
    t = torch.tensor(counts, device=rank_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


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
                done = when(events, "done", b.index)
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

    return save_figure("06_overlap", draw)


def staggered_step(ddp, optimizer, x, y) -> int:
    """One step in which every rank but 0 starts its backward ``STAGGER_S`` late; how many of
    rank 0's gradients became ready while one of its all_reduces was in flight (0 elsewhere).

    An all_reduce needs every rank, so rank 0's first one cannot finish before the others start
    backward: if rank 0 launched it during its backward (overlap), the gradients that follow
    arrive while it is in flight, however loaded the machine; if it waited at the launch or
    launched after backward, none does. The timed steps above show the same thing by chance."""
    dist.barrier()
    loss = F.mse_loss(ddp(x), y)
    optimizer.zero_grad()
    if dist.get_rank() > 0:
        time.sleep(STAGGER_S)
    ddp.reducer.timeline = []
    loss.backward()
    optimizer.step()
    return ready_while_in_flight(ddp.reducer.timeline) if dist.get_rank() == 0 else 0


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

    seconds = {name: [] for name in runs}
    exposed = {name: [] for name in runs}
    timelines, losses = {}, []
    for s in range(STEPS):
        x = x_all[s * LOCAL_BATCH:(s + 1) * LOCAL_BATCH]
        y = y_all[s * LOCAL_BATCH:(s + 1) * LOCAL_BATCH]
        grads, took = {}, {}
        for name in runs if s % 2 == 0 else reversed(runs):  # A B B A: neither always first
            loss, grads[name], events, took[name] = step(models[name], optimizers[name], x, y,
                                                         device)
            if s >= 2:  # from step 2 on, both run on the rebuilt buckets, warmed up
                seconds[name].append(took[name])
                exposed[name].append(when(events, "finalized") - when(events, "backward_end"))
                timelines.setdefault(name, []).append((took[name], events))
            if name == "overlap":
                losses.append(loss.detach())
        if s % 5 == 0 or s == STEPS - 1:  # each run's own time: they ran one after the other
            print0(f"step {s:>2}/{STEPS} | loss {mean_over_ranks(losses[-1]):.5f} | step time: "
                   + ", ".join(f"{name} {1e3 * took[name]:6.2f} ms" for name in runs))
        same = all(torch.equal(a, b) for a, b in zip(grads["overlap"], grads["after backward"]))
        check(same, f"step {s}, rank {rank}: the overlapped gradients differ from the "
                    "non-overlapped ones")
    first, last = mean_over_ranks(losses[0]), mean_over_ranks(losses[-1])
    check(last < 0.5 * first, f"the loss went from {first:.4f} to {last:.4f}: not below half")

    overlapped = on_any_rank([ready_while_in_flight(e) for _, e in timelines["overlap"]])
    control = on_any_rank([ready_while_in_flight(e) for _, e in timelines["after backward"]])
    in_flight_steps = sum(n > 0 for n in overlapped)
    buckets = models["overlap"].buckets
    print0(f"\n{len(buckets)} buckets; in the timed steps, with overlap, gradients became ready "
           f"while an all_reduce was in flight in {in_flight_steps} of {len(overlapped)} steps "
           f"(a median of {statistics.median(overlapped):g} of "
           f"{len(list(models['overlap'].parameters()))} per step, on the rank that saw most); "
           f"without overlap, in {sum(n > 0 for n in control)}. How often depends on the load")
    staggered = {name: on_any_rank([staggered_step(models[name], optimizers[name], x, y)
                                    for _ in range(STAGGERED_STEPS)]) for name in runs}
    print0(f"{STAGGERED_STEPS} steps with the other ranks starting backward {STAGGER_S:g} s "
           f"late: gradients ready on rank 0 while its all_reduce was in flight: "
           + ", ".join(f"{name} {counts}" for name, counts in staggered.items()))
    trace = runs_dir() / "06_overlap.json"  # the overlap run's last staggered step, every rank
    chrome = save_chrome_trace(trace, models["overlap"].reducer.timeline, buckets)
    print0(f"saved {trace}: every rank's last staggered step as a Chrome trace; open it at "
           "https://ui.perfetto.dev or chrome://tracing")
    first = next(e for e in chrome["traceEvents"]
                 if e["pid"] == 0 and e["name"] == "all_reduce bucket 0")
    check(first["dur"] > 0.5e6 * STAGGER_S, f"the Chrome trace shows rank 0's first all_reduce "
          f"lasting {first['dur'] / 1e3:.1f} ms; it cannot end before the ranks that start "
          f"backward {STAGGER_S:g} s late join it")
    check(any(staggered["overlap"]), "with overlap, rank 0's gradients must become ready while "
          "an all_reduce is in flight when the other ranks start backward late (its first "
          "all_reduce cannot finish before they join); none did in "
          f"{STAGGERED_STEPS} such steps: {staggered['overlap']}. The all_reduces were waited "
          "for as soon as they were launched, or launched only after backward")
    check(not any(staggered["after backward"]) and not any(control),
          "the control, which launches after backward, overlapped communication with "
          f"backward: {staggered['after backward']}, {control}. The check above could not "
          "tell them apart")

    print0(f"\n{'median over steps':<18} {'step':>9} {'exposed communication':>22}")
    for name in runs:
        print0(f"{name:<18} {1e3 * statistics.median(seconds[name]):7.2f}ms "
               f"{1e3 * statistics.median(exposed[name]):20.2f}ms")
    print0("(exposed: from the last gradient computed to backward() returning. On a CPU with "
           "few cores these\ntimes are noisy and the saving can be small or none: see the "
           "docstring)")
    # the step of median duration, one per run, stands for the rest in the picture
    if draw_timelines({name: sorted(steps, key=lambda x: x[0])[len(steps) // 2][1]
                       for name, steps in timelines.items()}, buckets):
        print0("(the picture shows the order of events: each bucket's all_reduce in flight "
               "while earlier layers'\ngradients still arrive. On a CPU with gloo that need "
               "not be a speed-up: the overlap run can be\nthe slower one, gloo's threads "
               "competing with backward for the same cores)")
    return len(buckets), STEPS


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    buckets, steps = launch(on_every_rank, args.nproc)[0]
    ok(f"{buckets} buckets launched during backward, with gradients becoming ready while "
       f"all_reduces were in flight, and {steps} steps gave the non-overlapped gradients bit "
       "for bit")


if __name__ == "__main__":
    main()
