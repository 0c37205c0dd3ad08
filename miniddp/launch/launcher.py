"""Start ranks on this machine, or join the ranks torchrun started.

``launch(fn, world_size)`` is how every lesson, the reference job and the benchmarks run code
on N ranks: started plainly, it forks the ranks itself (see ``miniddp.launch.rank_group``: timeouts,
rank-named errors, no orphans); started by torchrun, this process *is* one rank, and it joins
the group torchrun describes in its environment. The same script works both ways.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from miniddp.launch.rank_group import RankError, RankGroup, leave_group

__all__ = ["CollectiveFailed", "RankError", "RankGroup", "Stopped", "collective",
           "default_backend", "join_torchrun_group", "launch", "launched_by_torchrun",
           "leave_group", "rank_device", "spawn", "stop_on_signals"]


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher using its variables) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_backend(ranks_on_this_machine: int = 1) -> str:
    """NCCL when every rank on this machine can have a GPU of its own, gloo otherwise.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so 2 ranks on a 1-GPU
    machine fall back to gloo, which runs anywhere.
    """
    # device_count() asks NVML and leaves CUDA uninitialized: forked ranks can still use it.
    return "nccl" if torch.cuda.device_count() >= ranks_on_this_machine else "gloo"


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL (which reduces GPU tensors only), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _store_for_this_attempt(store: dist.Store) -> dist.Store:
    """A fresh key space in torchrun's store for each restart attempt.

    torchrun's agent keeps one rendezvous store across ``--max-restarts`` attempts. Restarted
    gloo workers would read the dead workers' addresses left in it and hang or fail (pytorch
    issue 135712), so each attempt uses keys of its own. ``TORCHELASTIC_RESTART_COUNT`` agrees
    across the ranks of one node only; across nodes set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    """
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    one_node = int(os.environ.get("GROUP_WORLD_SIZE", "1")) == 1
    if not (shared and one_node):
        return store
    return dist.PrefixStore(f"miniddp/attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store)


def join_torchrun_group(backend: str | None = None, pg_timeout: float = 30.0) -> None:
    """Form the process group torchrun describes in the environment (restart-safe)."""
    backend = backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    limit = timedelta(seconds=pg_timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=limit))
    dist.init_process_group(backend, store=_store_for_this_attempt(store), rank=rank,
                            world_size=world_size, timeout=limit)


class CollectiveFailed(RuntimeError):
    """A collective did not complete: a rank stopped taking part, or left the group."""

    def __init__(self, message: str, peer_gone: bool):
        super().__init__(message)
        self.peer_gone = peer_gone


def _is_communication_error(error: BaseException) -> bool:
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return any(s in text for s in ("gloo", "nccl", "timed out", "timeout", "connection",
                                   "broken pipe", "socket"))


@contextmanager
def collective(what: str, timeout: float):
    """Name the operation when a collective inside fails, and say which way it failed.

    torch's own message says a socket timed out or a peer closed a connection; the user needs
    to know which step of their job was waiting, for how long, and whether a peer vanished
    (its own error is the cause) or stopped taking part (hung, deadlocked, far slower).
    """
    start = time.monotonic()
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, CollectiveFailed) or not _is_communication_error(error):
            raise
        waited = time.monotonic() - start
        timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
        if timed_out:
            why = (f"timed out after {waited:.1f} s (--timeout {timeout:g}): a rank stopped "
                   "taking part (hung, deadlocked, or far slower than the others)")
        else:
            why = (f"another rank left the group after {waited:.1f} s (it failed or was killed; "
                   "its own error is the cause)")
            if launched_by_torchrun():  # its stderr is torchrun's to show, not ours
                why += (". A rank that died without a traceback (an exit code only) wrote why on "
                        "its stderr: in torchrun's output, or with --log-dir DIR --redirects 2 "
                        "in DIR/<run id>_*/attempt_<n>/<local rank>/stderr.log")
        raise CollectiveFailed(f"rank {dist.get_rank()}: {what} did not complete: {why}.",
                               peer_gone=not timed_out) from error  # torch's error is chained


class Stopped(SystemExit):
    """SIGTERM or SIGHUP arrived. A ``SystemExit`` (status 128 + the signal's number, as a shell
    reports it), so a script that does not catch it exits quietly, after its cleanup has run."""

    def __init__(self, signum: int):
        self.signal = signal.Signals(signum)
        super().__init__(128 + signum)


@contextmanager
def stop_on_signals():
    """Inside: SIGTERM and SIGHUP raise :class:`Stopped` instead of killing the process at once.

    Killed by default, a launcher would leave its ranks' temporary directory behind; raised as
    an exception, every ``with`` and ``finally`` on the way out runs: the ranks are killed and
    the directory removed. Only default handlers are replaced, and only in the main thread
    (Python runs signal handlers there alone). SIGKILL cannot be caught: see
    ``miniddp.launch.rank_group.remove_stale_group_dirs`` for what it leaves.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    replaced = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            replaced[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in replaced.items():
            signal.signal(sig, handler)


def spawn(fn, world_size: int = 2, args=(), backend: str = "gloo",
          timeout: float | None = 120.0, pg_timeout: float = 30.0) -> list:
    """Fork ``world_size`` ranks, run ``fn(*args)`` on each, return their results.

    ``timeout`` bounds the whole call (``None``: no bound, for long training jobs; a rank that
    stops taking part still fails after ``pg_timeout``).
    """
    with stop_on_signals(), RankGroup(world_size, backend=backend, pg_timeout=pg_timeout) as group:
        return group.run(fn, *args, timeout=timeout)


def launch(fn, world_size: int = 2, args=(), backend: str | None = None,
           timeout: float | None = 120.0, pg_timeout: float = 30.0) -> list:
    """Run ``fn(*args)`` on every rank, whoever starts the ranks.

    Under torchrun this process is one rank: it joins the group from torchrun's environment,
    runs ``fn`` and returns ``[its result]``. Started plainly, it forks ``world_size`` ranks, or,
    once this process has run a backward on a machine with a GPU (after which torch forbids
    autograd in a forked child), starts them from a forkserver, which imports the script again:
    keep its top-level code under ``if __name__ == "__main__":`` (``miniddp.launch.start_methods``).
    ``backend=None`` picks NCCL when every rank on this machine gets a GPU, gloo otherwise.
    """
    if not launched_by_torchrun():
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "launch() starts ranks that each create their own process group, but this "
                "process already has one (torch.distributed.init_process_group was called "
                "here, or this is a rank itself): call launch from a process without one, or "
                "call torch.distributed.destroy_process_group() first.")
        backend = backend or default_backend(world_size)
        return spawn(fn, world_size, args, backend, timeout, pg_timeout)
    join_torchrun_group(backend, pg_timeout)
    try:
        return [fn(*args)]
    finally:
        leave_group()
