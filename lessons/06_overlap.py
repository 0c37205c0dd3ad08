"""Lesson 06: overlapping communication with backward: DDP's reducer, written small.

What this adds since lesson 05: buckets made communication cheaper; this makes it start earlier.
Backward computes gradients from the last layer to the first, so the last layers' gradients are
final long before it ends. A hook on every parameter copies its gradient into its bucket as
soon as it is final; a full bucket's all_reduce is launched at once (``async_op=True``) while
backward goes on with earlier layers; a callback queued on the autograd engine waits for every
bucket at the end and writes the averages into ``.grad``, so ``loss.backward()`` returns with
synchronized gradients.

Why it matters: a step then costs about max(compute, communication) instead of their sum (the
DDP paper: 22-38% shorter iterations on GPUs). What stays exposed is the last bucket's
communication, which is why the first bucket is kept small.

The idea, in about 50 lines: ``SmallReducer``. The hooks (``register_post_accumulate_grad_hook``),
``grad * (1 / world_size)`` into the bucket, buckets launched strictly in order (every rank must
issue the same collectives in the same order), and the callback
(``Variable._execution_engine.queue_callback``) that waits and writes back; one bucket for the
first step, then ``rebuilt_buckets`` in the order the gradients arrived. It is checked bit for
bit against torch's DDP at every step, at 2 ranks and at 3 (where the layout decides the bits).
The library's ``miniddp.reducer.Reducer`` (with its ``Bucket``) is this small version plus
DDP's options, each acting at the line where it changes a step: its steps are printed beside
``SmallReducer``'s (checked to be the ones a backward runs), then the lines where options act,
read from its source. With ``bucket_cap_mb=0.5`` its buckets hold one hidden layer each
(checked), and one backward recorded with ``ddp.trace()`` must launch every bucket once, in
order, and wait for each, in order, before the write-back.
Part 2 (``06_overlap_timeline.py``) proves from the reducer's timeline that it overlaps.

Run it:

    python lessons/06_overlap.py              # forks 2 ranks, gloo on CPU
    python lessons/06_overlap.py --trace      # one backward, event by event, every rank
    torchrun --standalone --nproc_per_node=2 lessons/06_overlap.py

What you should see: ``SmallReducer`` equal to torch's DDP bit for bit at 2 ranks, then at 3;
its steps beside the library's; the library's buckets by layer; the trace's verdict (with
``--trace``, every gradient ready, each bucket launched, finished and waited for, the
write-back); ``OK: ...``. About 15 s.
"""

import argparse
import functools
import inspect
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course.data import IN_FEATURES, OUT_FEATURES, make_dataset
from course.report import check, ok, print0
from miniddp import DistributedDataParallel
from miniddp.buckets import Bucket, bucket_limits
from miniddp.launch import launch, launched_by_torchrun, rank_device
from miniddp.reducer import Reducer
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET

LAYERS, WIDTH = 4, 384  # each hidden weight is 576 KiB: with a 0.5 MiB cap, one hidden layer
# per bucket (the small output layer joins the first, the input layer has the last)
BUCKET_CAP_MB = 0.5
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
    by event with ``--trace`` (tests/course/test_lesson_mechanisms.py checks what the trace
    prints)."""
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


#: Each step of ``SmallReducer`` and the library's step that does it (the reducer's, or the
#: bucket's own).
SIDE_BY_SIDE = (
    ("the hook: this parameter's gradient is final", "_on_ready", Reducer._hook),
    ("grad * (1 / world_size) into its bucket", "_on_ready", Bucket.fill),
    ("launch the full buckets, strictly in order", "_on_ready", Reducer._launch_ready_buckets),
    ("one bucket's all_reduce, async", "_on_ready", Bucket.launch),
    ("end of backward: wait for each bucket", "_finish", Reducer._finalize),
    ("a bucket's averages into .grad", "_finish", Bucket.write_back),
)


def beside_the_library() -> list[str]:
    """``SmallReducer``'s steps beside the library's, with their lengths in lines, read from the
    sources; then the lines of the reducer where an option changes a step."""
    def lines(function) -> int:
        return len(inspect.getsource(function).splitlines())
    rows = [f"{'step':<50}{'SmallReducer':<22}miniddp"]
    for what, small, library in SIDE_BY_SIDE:
        rows.append(f"{what:<50}{small + f' ({lines(getattr(SmallReducer, small))})':<22}"
                    f"{library.__qualname__} ({lines(library)})")
    options = [line.strip() for line in inspect.getsource(Reducer).splitlines()
               if "# options/" in line]
    rows.append(f"where DDP's options act ({len(options)} lines of the reducer, each None until "
                "an option is attached):")
    rows += [f"    {line}" for line in options]
    return rows


def library_steps_not_run(ddp, x, y) -> list[str]:
    """The library steps of ``SIDE_BY_SIDE`` that one synchronized step does not run (the
    hooks run on this thread on a CPU; on a GPU, on autograd's device threads, unwatched)."""
    ran = set()

    def profile(frame, event, _arg):
        if event == "call":
            ran.add(frame.f_code)
    sys.setprofile(profile)
    try:
        F.mse_loss(ddp(x), y).backward()
    finally:
        sys.setprofile(None)
    return [library.__qualname__ for _, _, library in SIDE_BY_SIDE
            if library.__code__ not in ran]


def on_every_rank(show_the_trace: bool):
    device = rank_device()
    buckets_by_hand = small_reducer_matches_torch()
    print0(f"SmallReducer ({buckets_by_hand} buckets after the rebuild) gave torch's DDP's "
           f"gradients bit for bit at every step on {dist.get_world_size()} ranks\n")
    print0("\n".join(beside_the_library()) + "\n")
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(wide_student(device), device_ids=ids,
                                  bucket_cap_mb=BUCKET_CAP_MB)
    x, y = (t.to(device) for t in make_dataset(n=LOCAL_BATCH, seed=dist.get_rank()).tensors)
    F.mse_loss(ddp(x), y).backward()  # the buckets are rebuilt at the next forward
    if device.type == "cpu":
        missing = library_steps_not_run(ddp, x, y)
        check(not missing, f"a synchronized step did not run the library steps {missing} "
              "printed above: the table shows code that does not run")
        print0("a synchronized step ran every library step in the table above")
    ddp.zero_grad()
    traced_backward(ddp, x, y, show_the_trace)
    check_layout(ddp)
    return len(ddp.buckets)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    parser.add_argument("--trace", action="store_true",
                        help="print one backward event by event, rank after rank")
    args = parser.parse_args()
    buckets = launch(on_every_rank, args.nproc, (args.trace,))[0]
    if not launched_by_torchrun() and args.nproc != 3:
        launch(small_reducer_matches_torch, 3)  # where the bucket layout decides the bits
        print0("SmallReducer gave torch's DDP's gradients bit for bit on 3 ranks too")
    ok(f"SmallReducer equals torch's DDP bit for bit; the library's {buckets} buckets were "
       "launched once each, in order, and waited for in order before the write-back")


if __name__ == "__main__":
    main()
