"""Checks and traces: what DDP looks like from the inside, and what catches ranks out of step.

* ``consistency``: replicas that drift apart, ranks that fall out of step, failed waits
  explained, late gradients (``TORCH_DISTRIBUTED_DEBUG``, ``ddp.check_every(n)``);
* ``ledger``: the store where ranks write what they are doing; ``fingerprints``: every
  collective compared before it runs; ``out_of_step``: the messages;
* ``trace``: ``ddp.trace()``, the reducer's events on a timeline; ``chrome_trace``: every rank's
  events as one Chrome trace (the JSON Perfetto and chrome://tracing open).

The engine imports none of this. The checks attach to it at named points: ``attach`` below is
registered on ``DistributedDataParallel.checks`` when ``miniddp`` is imported, and each new
reducer gets its ``watch`` (and, when switched on, its ``consistency``) from there.
"""

from __future__ import annotations

from miniddp.checks import consistency
from miniddp.checks.trace import trace_backward
from miniddp.ddp import DistributedDataParallel


class Attach:
    """What the engine calls: the checks of a new reducer, ``check_every``, ``trace``."""

    @staticmethod
    def to_reducer(ddp, reducer) -> None:
        consistency.attach(ddp, reducer)

    @staticmethod
    def check_every(ddp, steps: int | None, detail: bool) -> None:
        consistency.check_every(ddp, steps, detail)

    @staticmethod
    def trace(ddp, all_ranks: bool):
        return trace_backward(ddp, all_ranks)


DistributedDataParallel.checks = Attach
