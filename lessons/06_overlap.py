"""Lesson 06: overlapping communication with backward, built by hand, then seen on a timeline.

What this adds since lesson 05: buckets made communication cheaper; this makes it start earlier.
Backward computes gradients from the last layer to the first, so the last layers' gradients are
final long before it ends. A hook on every parameter copies its gradient into its bucket as
soon as it is final; a full bucket's all_reduce is launched at once (``async_op=True``) while
backward goes on; a callback queued on the autograd engine waits for every bucket at the end and
writes the averages into ``.grad``. ``AllReduceBucketsAfterBackward`` is the rung before: the
same buckets, launched only once backward has ended.

Why it matters: a step then costs about max(compute, communication) instead of their sum (the
DDP paper: 22-38% shorter iterations on GPUs). What stays exposed is the last bucket's
communication, which is why the first bucket is kept small.

The idea, in about 50 lines: ``SmallReducer`` (the hooks, ``grad * (1 / world_size)`` into the
bucket, buckets launched strictly in order, the callback that waits and writes back, one bucket
for the first step and then ``rebuilt_buckets`` in arrival order), checked bit for bit against
torch's DDP at every step, at 2 and at 3 ranks. The library's full version is
``miniddp.reducer.Reducer`` (unused parameters, ``no_sync``, errors that name the parameter...).

The proof that the library overlaps is its own record, ``ddp.reducer.timeline``. Trained beside
``AllReduceBucketsAfterBackward`` on the same data, with ``bucket_cap_mb=0.5`` (one hidden layer
per bucket, checked): gradients must become ready while an all_reduce is in flight, shown in
the timed steps and checked in steps where every rank but 0 starts backward late (rank 0's first
all_reduce cannot finish before they join); never without overlap; the same gradients bit for
bit; and one backward recorded with ``ddp.trace()`` must launch every bucket once, in order, and
wait for each, in order, before the write-back.

On a 2-core CPU gloo's helper thread competes with backward for the cores, so the step-time gain
is small or none: the picture shows the order of events, not a speed-up (that needs a GPU, where
NCCL has its own stream; there the timeline records when the CPU launched work).

Run it:

    python lessons/06_overlap.py              # forks 2 ranks, gloo on CPU
    python lessons/06_overlap.py --trace      # one backward, event by event, every rank
    torchrun --standalone --nproc_per_node=2 lessons/06_overlap.py

What you should see: ``SmallReducer`` equal to torch's DDP; the loss falling; step times and
exposed communication of both runs; gradients ready while an all_reduce was in flight (counted,
and in the staggered steps); the trace's verdict; ``runs/06_overlap.png``; ``OK: ...``. 15 s.
"""

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from miniddp import AllReduceBucketsAfterBackward, DistributedDataParallel
from miniddp.buckets import bucket_limits
from miniddp.launch import launch, launched_by_torchrun, rank_device
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET
from miniddp.train.data import IN_FEATURES, OUT_FEATURES, make_dataset
from miniddp.train.report import check, mean_over_ranks, ok, print0, save_figure

LAYERS, WIDTH = 4, 384  # each hidden weight is 576 KiB: with a 0.5 MiB cap, one hidden layer
# per bucket (the small output layer joins the first, the input layer has the last)
BUCKET_CAP_MB = 0.5
STEPS = 30
STAGGERED_STEPS = 3
STAGGER_S = 0.2  # seconds: rank 0's backward of this model takes milliseconds
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


class SmallReducer:
    """DDP's reducer, small: hooks fill buckets, a full bucket is all_reduced at once (async),
    and a callback at the end of backward waits for every bucket and writes the averages back.

    ``buckets`` lists parameter indices per bucket, in launch order. The timeline records
    ``(event, index, time)`` as ``miniddp.reducer.Reducer`` does.
    """

    def __init__(self, model: nn.Module, buckets: list[list[int]]):
        self.params = list(model.parameters())
        self.world_size = dist.get_world_size()
        self.timeline: list[tuple[str, int, float]] = []
        self.set_buckets(buckets)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_ready, i))

    def set_buckets(self, buckets: list[list[int]]) -> None:
        """One flat buffer per bucket; each parameter writes into its own slice (a view)."""
        self.buckets, self.flat, self.views = buckets, [], {}
        for b, members in enumerate(buckets):
            first = self.params[members[0]]
            flat = torch.empty(sum(self.params[i].numel() for i in members),
                               dtype=first.dtype, device=first.device)
            offset = 0
            for i in members:
                n = self.params[i].numel()
                self.views[i] = (b, flat[offset:offset + n].view_as(self.params[i]))
                offset += n
            self.flat.append(flat)
        self.missing = [len(members) for members in buckets]
        self.in_flight = []  # the launched all_reduces, in bucket order

    def _on_ready(self, i: int, param: torch.Tensor) -> None:
        """The hook: ``param.grad`` is final. Copy it, scaled, into its bucket; launch."""
        self._record("ready", i)
        b, view = self.views[i]
        torch.mul(param.grad, 1.0 / self.world_size, out=view)  # torch's op, for torch's bits
        self.missing[b] -= 1
        while len(self.in_flight) < len(self.buckets) and self.missing[len(self.in_flight)] == 0:
            k = len(self.in_flight)  # buckets strictly in order, the same on every rank
            self._record("launch", k)
            self.in_flight.append(dist.all_reduce(self.flat[k], async_op=True))
            if k == len(self.buckets) - 1:  # the last one: finish when backward does
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        """Runs once backward has computed every gradient: wait, then write back."""
        self._record("backward_end", -1)
        for b, work in enumerate(self.in_flight):
            work.wait()
            self._record("waited", b)
            for i in self.buckets[b]:
                self.params[i].grad.copy_(self.views[i][1])
        self._record("finalized", -1)
        self.missing = [len(members) for members in self.buckets]
        self.in_flight = []

    def _record(self, event: str, ident: int) -> None:
        self.timeline.append((event, ident, time.perf_counter()))


def rebuilt_buckets(params, ready_order: list[int], first_bytes: int, cap_bytes: int):
    """torch's rebuild: buckets in the order gradients became ready; the first closes once it
    holds ``first_bytes``, the others at ``cap_bytes`` (one dtype and device here)."""
    buckets, size = [[]], 0
    for i in ready_order:
        buckets[-1].append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= (first_bytes if len(buckets) == 1 else cap_bytes):
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


def small_reducer_matches_torch(steps: int = 4) -> int:
    """Train ``SmallReducer`` and torch's DDP side by side; equal bit for bit at every step."""
    device = rank_device()
    ids = [device.index] if device.type == "cuda" else None
    theirs = TorchDDP(wide_student(device), device_ids=ids, bucket_cap_mb=BUCKET_CAP_MB)
    model = wide_student(device)
    n = len(list(model.parameters()))
    reducer = SmallReducer(model, [list(range(n))])  # step 0: one bucket, as torch
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (model, theirs)]
    x_all, y_all = (t.to(device) for t in make_dataset(n=LOCAL_BATCH * steps,
                                                        seed=dist.get_rank()).tensors)
    for s in range(steps):
        x, y = x_all[s * LOCAL_BATCH:(s + 1) * LOCAL_BATCH], y_all[s * LOCAL_BATCH:][:LOCAL_BATCH]
        for m, optimizer in zip((model, theirs), optimizers):
            optimizer.zero_grad()
            F.mse_loss(m(x), y).backward()
        for p, q in zip(model.parameters(), theirs.parameters()):
            check(torch.equal(p.grad, q.grad), f"step {s}, rank {dist.get_rank()}: SmallReducer's "
                  f"gradients differ from torch's DDP (buckets {reducer.buckets})")
        for optimizer in optimizers:
            optimizer.step()
        if s == 0:  # torch rebuilds its buckets at the next forward, in the order just seen
            order = [i for event, i, _ in reducer.timeline if event == "ready"]
            reducer.set_buckets(rebuilt_buckets(reducer.params, order,
                                                *bucket_limits(BUCKET_CAP_MB)))
    return len(reducer.buckets)


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


def reducer_work_problems(events, buckets: int) -> list[str]:
    """What is missing from one rank's recorded backward: every bucket launched once, in order;
    every launched bucket waited for, in launch order, between the end of backward and the
    write-back."""
    kinds = [kind for kind, _, _ in events]
    launched = [i for kind, i, _ in events if kind == "launch"]
    waited = [i for kind, i, _ in events if kind == "waited"]
    problems = []
    if launched != list(range(buckets)):
        problems.append(f"buckets launched {launched}, expected {list(range(buckets))}")
    if waited != launched:
        problems.append(f"buckets waited for {waited}, but launched {launched}: every launched "
                        "all_reduce must be waited for, in launch order")
    if kinds.count("backward_end") != 1 or kinds.count("finalized") != 1:
        return problems + ["no single end of backward and write-back"]
    end, written = kinds.index("backward_end"), kinds.index("finalized")
    if any(kind == "waited" and not end < at < written for at, kind in enumerate(kinds)):
        problems.append("a wait outside the end of backward and the write-back")
    return problems


def traced_backward(ddp, x, y, show: bool) -> None:
    """One more backward, recorded by ``ddp.trace()`` on every rank and checked; printed event
    by event with ``--trace`` (tests/test_lesson_mechanisms.py checks what the trace prints)."""
    dist.barrier()  # start together: each rank's times count from its own ``with``
    loss = F.mse_loss(ddp(x), y)
    with ddp.trace(all_ranks=True) as trace:
        loss.backward()
    for each in trace.others:
        problems = reducer_work_problems(each.events, len(ddp.buckets))
        check(not problems, f"the trace of rank {each.rank}'s backward does not show the "
              f"reducer's work: {'; '.join(problems)}")
    if show:
        print0(f"\none backward, event by event (--trace):\n{trace.format()}")
    print0(f"the trace of one backward on every rank shows each of the {len(ddp.buckets)} "
           "buckets launched once, in order, and waited for, in order, "
           "between the end of backward and the write-back")


def check_layout(ddp) -> None:
    """Print the buckets by layer and check what the docstring says of them: one hidden layer
    per bucket, the output layer in the first, the input layer alone in the last."""
    names = [name for name, _ in ddp.module.named_parameters()]
    params = list(ddp.module.parameters())
    layers = [sorted({names[i].split(".")[0] for i in b.param_indices}, key=int, reverse=True)
              for b in ddp.buckets]
    print0("the buckets, by layer (nn.Sequential's index): "
           + " ".join(f"[{', '.join(layer)}]" for layer in layers))
    hidden = [sum(params[i].shape == (WIDTH, WIDTH) for i in b.param_indices)
              for b in ddp.buckets]
    expected = [1] * LAYERS if EXPLICIT_CAP_COVERS_FIRST_BUCKET else [2] + [1] * (LAYERS - 2)
    output, inputs = str(2 * LAYERS + 2), "0"
    check(hidden == expected + [0] and output in layers[0] and layers[-1] == [inputs],
          f"with bucket_cap_mb={BUCKET_CAP_MB} the buckets hold the layers {layers} (hidden "
          f"weights per bucket {hidden}), not one hidden layer per bucket with the output layer "
          "in the first and the input layer alone in the last")


def on_every_rank(show_the_trace: bool):
    rank = dist.get_rank()
    device = rank_device()
    ids = [device.index] if device.type == "cuda" else None
    buckets_by_hand = small_reducer_matches_torch()
    print0(f"SmallReducer ({buckets_by_hand} buckets after the rebuild) gave torch's DDP's "
           f"gradients bit for bit at every step on {dist.get_world_size()} ranks\n")

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
    check_layout(models["overlap"])
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
    traced_backward(models["overlap"], x_all[:LOCAL_BATCH], y_all[:LOCAL_BATCH], show_the_trace)
    return len(buckets), STEPS


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    parser.add_argument("--trace", action="store_true",
                        help="print one backward event by event, rank after rank")
    args = parser.parse_args()
    buckets, steps = launch(on_every_rank, args.nproc, (args.trace,))[0]
    if not launched_by_torchrun() and args.nproc != 3:
        launch(small_reducer_matches_torch, 3)  # where the bucket layout decides the bits
        print0("SmallReducer gave torch's DDP's gradients bit for bit on 3 ranks too")
    ok(f"SmallReducer equals torch's DDP bit for bit; {buckets} buckets launched during "
       "backward, with gradients becoming ready while all_reduces were in flight, and "
       f"{steps} steps gave the non-overlapped gradients bit for bit")


if __name__ == "__main__":
    main()
