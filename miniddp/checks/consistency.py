"""Catching replicas that drift apart and ranks that fall out of step (which torch's DDP does not).

Data parallelism can go wrong without any error, in miniddp as in torch's DDP:

* **replicas drift**: a second ``loss.backward(retain_graph=True)`` after the gradients were
  averaged adds a gradient no other rank sees; ``no_sync`` used at different forwards on
  different ranks averages gradients of different steps; a rank-local in-place edit of a
  parameter, a nondeterministic op. Each rank trains on, with different weights;
* **ranks fall out of step**: one rank skips a backward, runs ``no_sync`` alone or one step
  fewer, and the others wait for the whole timeout - then the report blames a rank that
  waited, not the one that skipped.

What miniddp does about it, by mode:

* **off** (the default): nothing on the hot path. Two things cost nothing until they happen: a
  gradient that arrives after this forward's gradients were averaged warns once, naming the
  parameter (:meth:`Watch.late_gradient`); a bucket's all_reduce that fails says where every
  rank was waiting, and which ranks never arrived (:meth:`Watch.failed_wait`).
* **checks on** (``TORCH_DISTRIBUTED_DEBUG=INFO``, or ``ddp.check_every(n)``): at each
  synchronized forward every rank writes a small record to the store
  (``miniddp.checks.ledger``): its forward count, the forwards it ran inside ``no_sync`` and the
  synchronized forwards no backward followed since the last one, and every ``n`` steps a
  checksum of every parameter.
  At the end of that step's backward each rank reads the others' records (by then every rank
  has written its own: it did so before launching the all_reduces just waited for) and raises
  on every rank if they differ, naming the ranks, the step and what to change. A late gradient
  raises. Cost: a few store operations per step, and the checksums every ``n`` steps.
* **debug** (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, or ``check_every(n, detail=True)``): the
  checks, and every collective compared across ranks before it is launched
  (``miniddp.checks.fingerprints``).

:func:`check_replicas` compares the parameters once, on demand (one small all_gather), e.g.
at the end of every epoch. ``MINIDDP_CHECK_EVERY`` sets ``n`` for the environment switch
(default 100 with ``INFO``, 1 with ``DETAIL``).

One module because the modes are one dial: each adds to the one before it, and
:func:`attach` and :func:`check_every` turn the whole dial (the watch every reducer has, then
the checks, then the fingerprints); what a check writes to the store
(``miniddp.checks.ledger``) and the collectives' fingerprints (``miniddp.checks.fingerprints``)
live apart.
"""

from __future__ import annotations

import os
import warnings
import weakref

import torch
import torch.distributed as dist

from miniddp.checks import out_of_step
from miniddp.checks.fingerprints import CollectiveFingerprints
from miniddp.checks.ledger import Ledger, RecordsMissing
from miniddp.reducer import Step

DEBUG_VARIABLE = "TORCH_DISTRIBUTED_DEBUG"
EVERY_VARIABLE = "MINIDDP_CHECK_EVERY"
DEFAULT_EVERY = {"INFO": 100, "DETAIL": 1}
#: After a failed wait, how long to wait for the other ranks to say where they were waiting.
STALL_REPORT_S = 2.0


class OutOfStep(RuntimeError):
    """Ranks disagree on what they are doing (a skipped backward, no_sync on some ranks)."""


class ReplicasDiverged(RuntimeError):
    """Some parameters are not the same on every rank."""


class CollectiveStalled(RuntimeError):
    """A bucket's all_reduce did not complete (a timeout, or a rank that left)."""


class LateGradient(RuntimeError):
    """A gradient arrived after this forward's gradients were averaged across ranks."""


def debug_mode() -> str:
    """``OFF``, ``INFO`` or ``DETAIL``, from ``TORCH_DISTRIBUTED_DEBUG`` as torch reads it."""
    value = os.environ.get(DEBUG_VARIABLE, "").strip().upper() or "OFF"
    if value not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"{DEBUG_VARIABLE}={value!r}: use OFF, INFO or DETAIL")
    return value


def checks_from_environment(ddp, reducer=None) -> ConsistencyChecks | None:
    """The checks ``TORCH_DISTRIBUTED_DEBUG`` asks for, or None (off); ``reducer`` when it is
    not yet ``ddp.reducer`` (being built)."""
    mode = debug_mode()
    if mode == "OFF":
        return None
    every = os.environ.get(EVERY_VARIABLE, str(DEFAULT_EVERY[mode]))
    if not every.isdigit() or int(every) < 1:
        raise ValueError(f"{EVERY_VARIABLE}={every!r}: give a number of steps, 1 or more")
    return ConsistencyChecks(ddp, int(every), detail=mode == "DETAIL", reducer=reducer)


#: The reducer's events the checks listen to (``miniddp.reducer.EVENTS``).
CHECKED_EVENTS = ("forward", "rebuild", "buffers", "launch", "used_flags", "finalized")


class ConsistencyChecks:
    """The reducer's ``consistency`` when checks are on. See the module docstring."""

    def __init__(self, ddp, every: int, detail: bool = False, reducer=None):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"check every how many steps? Got {every!r}; give 1 or more")
        self.reducer = reducer or ddp.reducer
        self.ledger, self.every = self.reducer.watch.ledger, every
        self.ddp = weakref.ref(ddp)
        self.scope = self.ledger.new_scope()
        self.names, self.params = zip(*ddp.module.named_parameters())
        self.step = 0  # synchronized forwards since the checks were switched on
        self.unsynced: list[int] = []  # forwards inside no_sync since the last synced one
        self.no_backward: list[int] = []  # synced forwards that no backward followed
        self.awaiting: int | None = None  # the last synced forward, until its backward runs
        self.current = self.history()
        self.record: dict | None = None
        self.fingerprints = CollectiveFingerprints(self) if detail else None

    def history(self) -> dict:
        """This rank's forward count, and what it did since its last synchronized forward."""
        return {"forward": self.reducer.forwards, "unsynced": list(self.unsynced),
                "no_backward": list(self.no_backward)}

    def now(self) -> dict:
        """What this rank is doing, for a collective's fingerprint."""
        return {"forward": self.reducer.forwards, "unsynced": self.current["unsynced"],
                "no_backward": self.current["no_backward"]}

    @property
    def paused(self) -> bool:
        """Under ``join`` ranks legitimately run different numbers of steps: the checks stop
        once a join context has been entered (torch keeps its join settings afterwards)."""
        ddp = self.ddp()
        return ddp is None or ddp._join_config.enable

    def on_event(self, record: tuple) -> None:
        """The reducer's events that the checks follow (:data:`CHECKED_EVENTS`)."""
        event, ident, _ = record
        reducer = self.reducer
        if event == "forward":
            self.at_forward(bool(ident))
        elif event == "finalized":
            self.after_backward()
        elif event == "launch":
            self.before_collective("the all_reduce", ident, [reducer.buckets[ident].buffer])
        elif event == "rebuild":
            self.before_collective("the broadcast of the bucket order", None, [])
        elif event == "used_flags":
            self.before_collective("the all_reduce of used-parameter flags", None,
                                   [reducer.unused.locally_used])
        elif event == "buffers":
            ddp = self.ddp()
            self.before_collective("the broadcast of buffers", None,
                                   list(ddp._modules_buffers.values()))

    def at_forward(self, sync: bool) -> None:
        """Start of a forward with grad enabled: note it; a synced one writes its record."""
        if self.paused:
            return
        reducer = self.reducer
        if self.awaiting is not None and reducer.state is Step.EXPECTING:
            self.no_backward.append(self.awaiting)
        self.awaiting = None
        if not sync:
            self.unsynced.append(reducer.forwards)
            self.current = self.history()
            return
        self.step += 1
        self.awaiting = reducer.forwards
        self.current = self.record = {**self.history(), "step": self.step}
        if self.step % self.every == 0:
            self.record["checksums"] = parameter_checksums(self.params)
        self.ledger.write(f"{self.scope}step{self.step}", self.record)
        self.unsynced, self.no_backward = [], []

    def before_collective(self, what: str, bucket: int | None,
                          tensors: list[torch.Tensor]) -> None:
        if self.fingerprints is not None and not self.paused:
            self.fingerprints.before(what, bucket, tensors)

    def after_backward(self) -> None:
        """End of a synced backward: every rank's record for this step must agree."""
        if self.record is None or self.paused:  # switched on mid-step, or under join
            return
        where = f"synchronized step {self.step}"
        try:
            records = dict(enumerate(self.ledger.gather(f"{self.scope}step{self.step}")))
        except RecordsMissing as gone:
            raise self.fail(out_of_step.missing(where, gone.arrived, gone.missing, gone.last,
                                                gone.waited), OutOfStep) from None
        self.ledger.forget(f"{self.scope}step{self.step - 1}")  # everyone has read it by now
        signature = lambda r: (r["forward"], tuple(r["unsynced"]), tuple(r["no_backward"]))
        problem = out_of_step.disagreement(records, signature, where)
        if problem is not None:
            raise self.fail(problem, OutOfStep)
        if "checksums" in self.record:
            problem = replica_differences(self.names, {r: v["checksums"]
                                                       for r, v in records.items()}, where)
            if problem is not None:
                raise self.fail(problem, ReplicasDiverged)

    def fail(self, message: str, kind: type = OutOfStep) -> RuntimeError:
        """The error to raise; written to the ledger too, for ranks whose collectives fail."""
        message = f"rank {self.ledger.rank}: {message}"
        try:
            self.ledger.write("error", {"message": message})
        except RuntimeError:
            pass
        return kind(message)


# ----- replica checksums -----

_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parameter_checksums(tensors) -> list[list[int]]:
    """Two integers per tensor that change when any bit of it changes, computed exactly.

    The tensor's bits are read as integers and summed (and their squares summed) with int64
    arithmetic that wraps around: exact, so equal tensors give equal checksums on every rank
    whatever the order of the additions, and any single changed element changes the sum.
    """
    sums = []
    with torch.no_grad():
        for t in tensors:
            bits = t.detach().reshape(-1).view(_SAME_SIZE_INTEGER[t.element_size()]).long()
            sums.append(torch.stack([bits.sum(), (bits * bits).sum()]).cpu())
    return torch.stack(sums).tolist() if sums else []


def replica_differences(names, checksums: dict[int, list], where: str) -> str | None:
    """A message naming the first parameters whose checksums differ across ranks, or None."""
    differing = []
    for k, name in enumerate(names):
        by_rank = {r: {"checksum": tuple(sums[k])} for r, sums in checksums.items()}
        odd, normal = out_of_step.odd_ranks(by_rank, lambda record: record["checksum"])
        if odd:
            differing.append(f"{name!r} differs on ranks {odd} from ranks {normal}")
    if not differing:
        return None
    shown = "; ".join(differing[:5]) + (f"; and {len(differing) - 5} more"
                                         if len(differing) > 5 else "")
    return (f"replicas differ at {where}: {len(differing)} of {len(names)} parameters are not "
            f"the same on every rank: {shown}. Something changed some ranks' parameters only: "
            "a second backward after one forward (sum the losses and call backward once), "
            "no_sync() used at different steps on different ranks, an in-place edit of a "
            "parameter on some ranks, or an optimizer, scheduler or nondeterministic op that "
            "differs across ranks.")


def check_replicas(ddp, step: int | None = None) -> None:
    """Raise :class:`ReplicasDiverged` on every rank unless every parameter of ``ddp``'s module
    is bit-identical on every rank. Call it on every rank at the same point (one all_gather)."""
    group = getattr(ddp, "process_group", None)
    module = getattr(ddp, "module", ddp)
    names, params = zip(*module.named_parameters())
    mine = torch.tensor(parameter_checksums(params), dtype=torch.int64,
                        device=params[0].device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    where = "the check" if step is None else f"step {step}"
    problem = replica_differences(names, {r: t.tolist() for r, t in enumerate(everyone)},
                                  where)
    if problem is not None:
        raise ReplicasDiverged(f"rank {dist.get_rank()}: {problem}")


# ----- attached to every reducer: the two things that cost nothing until they happen -----

def attach(ddp, reducer) -> None:
    """Give a new reducer its :class:`Watch`, and the checks ``TORCH_DISTRIBUTED_DEBUG`` asks
    for (called when a DDP builds a reducer: ``DistributedDataParallel.checks``). Both listen
    to the reducer's events, and are kept on it as ``reducer.watch`` and
    ``reducer.consistency``."""
    reducer.watch = Watch(reducer)
    reducer.subscribe(reducer.watch.listen, ("late_gradient", "wait_failed"))
    reducer.consistency = None
    _switch(reducer, checks_from_environment(ddp, reducer))


def check_every(ddp, steps: int | None, detail: bool = False) -> None:
    """``ddp.check_every(steps, detail)``: switch the checks on (every ``steps`` steps), or off."""
    _switch(ddp.reducer, ConsistencyChecks(ddp, steps, detail) if steps else None)


def _switch(reducer, checks: ConsistencyChecks | None) -> None:
    if reducer.consistency is not None:
        reducer.unsubscribe(reducer.consistency.on_event)
    reducer.consistency = checks
    if checks is not None:
        reducer.subscribe(checks.on_event, CHECKED_EVENTS)


class Watch:
    """A reducer's ``watch``: warns (or raises) at a second backward through one forward, and
    explains a bucket's all_reduce that failed. It listens to those two events only, so nothing
    of it runs until one of them happens.

    It owns the reducer's :class:`~miniddp.checks.ledger.Ledger`, made here at construction
    (so ledgers are numbered in the same order on every rank) and opened at first use."""

    _warned: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, reducer):
        self._reducer = weakref.ref(reducer)  # the reducer holds its watch
        self.ledger = Ledger(reducer.group, reducer.params[0].device)

    def listen(self, record: tuple) -> None:
        """The reducer's ``late_gradient`` and ``wait_failed`` events."""
        event, ident, _ = record
        reducer = self._reducer()
        if event == "late_gradient":
            self.late_gradient(ident)
        elif event == "wait_failed":
            self.failed_wait(reducer.buckets[ident], reducer.error)

    def late_gradient(self, index: int) -> None:
        """A hook fired after this forward's gradients were averaged: warn once, or raise."""
        reducer = self._reducer()
        name = reducer.names[index]
        message = (
            f"parameter {name!r} got a gradient after this forward's gradients were already "
            "averaged across ranks, so that gradient stays local and the replicas drift apart: "
            "a second backward through one forward of the DDP model (loss.backward("
            "retain_graph=True) twice, or two losses from one forward). Add the losses and "
            "call backward once, or run one forward of the DDP model per backward.")
        if reducer.consistency is not None:
            raise LateGradient(message)
        if self not in self._warned:
            self._warned.add(self)
            warnings.warn(message + f" (warned once; {DEBUG_VARIABLE}=INFO makes it an error)",
                          stacklevel=3)

    def failed_wait(self, bucket, error: RuntimeError) -> None:
        """A bucket's all_reduce failed: raise an error saying where every rank was waiting.

        Each rank whose wait fails writes where it was to the ledger, then reads what the
        others write in the next few seconds: ranks stuck at the same all_reduce fail
        together, a rank stuck elsewhere shows where it is, and a rank that never reports is
        the likeliest culprit. A rank whose consistency check found the cause wrote its
        message: that is the answer. Any other error (a comm hook's own, say) is left to
        propagate as it is.
        """
        if not _communication_failed(error):
            return
        reducer, ledger = self._reducer(), self.ledger
        rank = dist.get_rank(reducer.group)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        text = (f"rank {rank}: the all_reduce of bucket {bucket.index} in the backward of "
                f"forward {reducer.forwards} did not complete ({first}). A rank may have "
                "skipped a step.")
        try:
            ledger.write("stalled", {"forward": reducer.forwards,
                                     "synced": reducer.synced_forwards,
                                     "bucket": bucket.index})
            waiting = ledger.collect("stalled", STALL_REPORT_S)
            errors = [ledger.read("error", r) for r in range(ledger.world_size)]
        except RuntimeError:  # the store is gone too: say what this rank knows
            raise CollectiveStalled(text) from error
        found = [e["message"] for e in errors if e]
        if found:
            raise OutOfStep(f"{text} The cause, found by the consistency check: {found[0]}") \
                from error
        raise CollectiveStalled(f"{text} {out_of_step.stalled(waiting, ledger.world_size)}") \
            from error


def _communication_failed(error: RuntimeError) -> bool:
    text = str(error).lower()
    return isinstance(error, getattr(dist, "DistError", ())) or any(
        marker in text for marker in ("timed out", "timeout", "connection", "closed", "peer",
                                      "gloo", "nccl", "socket", "broken pipe"))
