"""What several lessons share and none of them teaches: loading an earlier lesson, gathering a
value from every rank, timing in alternation and reading the times (lesson 11 says why so; the
benchmarks time with the same :func:`alternate`), an SGD that starts fast.

Kept out of the lessons so that each file is its idea; kept out of ``miniddp`` because none of
it is part of data parallelism.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course.report import print0

LESSONS = Path(__file__).resolve().parents[1] / "lessons"


def load_lesson(stem: str):
    """The module of ``lessons/<stem>.py`` (a lesson builds on an earlier one's code), loaded
    once and kept in ``sys.modules`` so that forked ranks find its functions by name."""
    name = f"lesson_{stem}"  # as tests/support/lesson_modules.py names it
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, LESSONS / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def everyone(value) -> list:
    """Every rank's ``value``, in rank order (a collective: every rank calls it)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it means something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest_rank(values: list, device: torch.device) -> list:
    """Element-wise maximum over ranks (a list, or a list of equally long lists): a step is over
    when its slowest rank is done. On NCCL the tensor lives on ``device``, else on the CPU."""
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def round_orders(names: list, rounds: int, seed: int = 0):
    """The order of each round: a new shuffle (seeded, so every rank runs the same call at the
    same time), never starting with the call that ended the round before.

    A step run twice in a row finds its own tensors still in cache. Going A..Z then Z..A did
    that at both ends of the list, every other round: an A/A run of torch's DDP against itself
    in the bucket sweep came out 1.06 at the last place (per parameter) in three runs out of
    three, and 0.93-0.99 at the first (benchmarks/README.md, "How the numbers are made").
    """
    rng, last = random.Random(seed), None
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        if len(order) > 1 and order[0] == last:
            order[0], order[-1] = order[-1], order[0]
        last = order[-1]
        yield order


def alternate(calls: dict, rounds: int, device: torch.device, warmup: int,
              label: str = "") -> dict[str, dict[str, list[float]]]:
    """Time ``calls`` (name -> function of no arguments) in rounds: each round runs every one
    once, in the order :func:`round_orders` gives, each after a barrier (untimed), so that the
    ranks start it together. The first ``warmup`` rounds are not timed.

    Returns, per call, ``wall`` (ms of each round, the slowest rank's) and ``cpu`` (ms of CPU
    time used by this rank's main thread: forward, CPU backward, hooks and copies, but not
    gloo's threads; it barely depends on how busy the machine is). With a ``label``, rank 0
    prints progress every 15 s. The lessons and the benchmarks (benchmarks/harness.py) share it.
    """
    names = list(calls)
    wall, cpu = {name: [] for name in names}, {name: [] for name in names}
    barrier = ({"device_ids": [device.index]} if device.type == "cuda"
               and dist.get_backend() == "nccl" else {})
    last_print = start = time.perf_counter()
    for k, order in enumerate(round_orders(names, warmup + rounds)):
        for name in order:
            sync(device)
            dist.barrier(**barrier)
            c0, t0 = time.thread_time(), time.perf_counter()
            calls[name]()
            sync(device)
            if k >= warmup:
                wall[name].append(1000 * (time.perf_counter() - t0))
                cpu[name].append(1000 * (time.thread_time() - c0))
        if label and k >= warmup and time.perf_counter() - last_print > 15:
            last_print = time.perf_counter()
            print0(f"    {label}: round {k + 1 - warmup}/{rounds} ({last_print - start:.0f} s)")
    slowest = slowest_rank([wall[name] for name in names], device)
    return {name: {"wall": slowest[i], "cpu": cpu[name]} for i, name in enumerate(names)}


def per_round(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The median of ``values`` and an interval that holds the true median with probability at
    least ``confidence``: ``[x_(k), x_(n+1-k)]``, the k-th smallest and k-th largest value.

    Each round's ratio falls below the true median with probability 1/2, so the count below it
    is Binomial(n, 1/2), and that interval misses the median only when k or fewer fall on one
    side: probability ``2 * P(B <= k - 1)``. Take the largest k that keeps this within
    ``1 - confidence``. Nothing is assumed about the shape of the noise.
    """
    ordered, n = sorted(values), len(values)
    below = lambda k: sum(math.comb(n, i) for i in range(k + 1)) / 2**n  # P(B <= k)
    k = 1
    while k < n // 2 and 2 * below(k) <= 1 - confidence:
        k += 1
    return statistics.median(ordered), ordered[k - 1], ordered[n - k]


def verdict(low: float, high: float) -> str:
    if low > 1:
        return "slower"
    if high < 1:
        return "faster"
    return "not shown"


def summarize_saved_sweeps(saved: Path, alpha: float, backend: str, device: str):
    """One line per sweep of ``benchmarks/bucket_sweep.py`` saved in ``benchmarks/results``, read
    by intervals: miniddp / torch at each cap (the saved 95% intervals), and one bucket per
    parameter over torch's best cap (the median of per-round ratios, every cap being timed in
    each round), with the model's prediction at this run's ``alpha`` where it applies (the same
    backend on the same kind of device)."""
    files = sorted(saved.glob("bucket_sweep-*.json"))
    if not files:
        print0(f"\nno saved sweep in {saved}: run python benchmarks/bucket_sweep.py")
        return
    print0(f"\nthe full sweeps saved in {saved.relative_to(saved.parents[1])} (95% intervals):")
    for path in files:
        saved = json.loads(path.read_text())
        setup, model, rows = saved["setup"], saved["model"], saved["sweep"]
        verdicts = [verdict(*row["ratio_ci95"]) for row in rows]
        counts = ", ".join(f"{word} at {verdicts.count(word)}"
                           for word in ("slower", "faster", "not shown") if word in verdicts)
        pooled = saved["all_caps"]
        line = (f"  {path.stem[len('bucket_sweep-'):]}: {model['tensors']} tensors, "
                f"{model['gradient_mb']:.0f} MB, {setup['pairs']} rounds; miniddp/torch "
                f"{counts} of {len(rows)} caps, pooled {pooled['ratio']:.3f} "
                f"({verdict(*pooled['ratio_ci95'])})")
        torch_ms = {row["bucket_cap_mb"]: row["torch"] for row in rows}
        if "per-parameter" in torch_ms:
            best = min((cap for cap in torch_ms if cap != "per-parameter"),
                       key=lambda cap: torch_ms[cap]["median_ms"])
            mid, low, high = median_interval(per_round(torch_ms["per-parameter"]["times_ms"],
                                                       torch_ms[best]["times_ms"]))
            line += (f"; one bucket per parameter {mid:.2f}x torch's best cap ({best} MiB; "
                     f"{low:.2f}-{high:.2f})")
            if (setup["backend"], setup["device"]) == (backend, device):
                buckets = {row["bucket_cap_mb"]: row["buckets"] for row in rows}
                extra = 1e3 * alpha * (buckets["per-parameter"] - buckets[best])
                line += f", model {1 + extra / torch_ms[best]['median_ms']:.2f}x"
        print0(line)
    print0("the method and all the numbers: benchmarks/README.md; rerun with "
           "python benchmarks/bucket_sweep.py (--quick for a smoke run)")


class PlainSGD:
    """``torch.optim.SGD(params, lr, momentum)``, written out, with the ``state_dict`` and
    ``load_state_dict`` a snapshot needs (torch's saves the same momentum buffers). Why not
    torch's: its constructor imports ``torch._dynamo``, 2-4 s of CPU in each fresh worker, and
    lesson 09 starts four."""

    def __init__(self, params, lr: float, momentum: float):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers = [None] * len(self.params)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if self.buffers[i] is None:  # the first step: the buffer is the gradient
                    self.buffers[i] = p.grad.clone()
                else:
                    self.buffers[i].mul_(self.momentum).add_(p.grad)
                p.add_(self.buffers[i], alpha=-self.lr)

    def state_dict(self) -> dict:
        return {"momentum_buffers": [None if b is None else b.clone() for b in self.buffers]}

    def load_state_dict(self, state: dict):
        self.buffers = [None if b is None else b.clone() for b in state["momentum_buffers"]]
