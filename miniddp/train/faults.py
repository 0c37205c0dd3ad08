"""Faults the tests inject into the reference job: a rank that raises, hangs, dies or drifts.

``--fault KIND:RANK:STEP`` makes rank RANK, at step STEP, ``raise``, ``hang`` (sleep instead of
taking part), ``exit`` (die without a word) or ``drift`` (nudge one of its weights in place, a
rank-local edit that only ``--check-every`` catches); under torchrun only in the first attempt,
so a restarted job gets past it. ``--pid-dir`` makes each rank write its pid to ``DIR/rank<R>.pid``,
so that a test can kill a rank from outside and check that none outlives the job.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def parse_fault(text: str) -> tuple[str, int, int]:
    kind, rank, step = text.split(":")
    if kind not in ("raise", "hang", "exit", "drift"):
        raise argparse.ArgumentTypeError(
            f"fault kind must be raise, hang, exit or drift, not {kind!r}")
    return kind, int(rank), int(step)


def write_pid_file(directory: str, rank: int) -> None:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(path + ".tmp", path)  # a reader never sees a half-written pid


def inject_fault(fault, rank: int, step: int, model=None) -> None:
    """Fire ``--fault`` once: in the first attempt, not again when torchrun restarts the job."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if fault is None or fault[1:] != (rank, step) or not first_attempt:
        return
    kind = fault[0]
    if kind == "drift":
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1e-3
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault: rank {rank} raises at step {step}")
    if kind == "hang":
        time.sleep(24 * 3600)  # alive, but never joins the next collective
    os._exit(3)
