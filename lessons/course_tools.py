"""What several lessons share and none of them teaches: loading an earlier lesson, gathering a
value from every rank, timing in alternation, an SGD that starts fast.

Kept out of the lessons so that each file is its idea; kept out of ``miniddp`` because none of
it is part of data parallelism. Not a lesson itself: its name starts with no number, so the
course (``run_course.py``) and the tests' glob pass it by.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def load_lesson(stem: str):
    """The module of ``lessons/<stem>.py`` (a lesson builds on an earlier one's code), loaded
    once and kept in ``sys.modules`` so that forked ranks find its functions by name."""
    name = f"lesson_{stem}"  # as tests/lesson_modules.py names it
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{stem}.py")
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


def alternating_times(calls: dict, device: torch.device, reps: int, warmup: int = 2) -> dict:
    """Seconds per run of each of ``calls`` (name -> function of no arguments), timed in turns
    (A B A B ...) so that a machine that slows down or speeds up mid-run affects all alike.
    The first ``warmup`` rounds are run and not kept."""
    seconds: dict = {name: [] for name in calls}
    for round_ in range(warmup + reps):
        for name, call in calls.items():
            sync(device)
            start = time.perf_counter()
            call()
            sync(device)
            if round_ >= warmup:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median of the pairwise ratios ``a[i] / b[i]`` of two alternating series."""
    return statistics.median(x / y for x, y in zip(a, b))


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
