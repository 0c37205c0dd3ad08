"""Forked ranks in one process group: the machinery under ``miniddp.launch``.

Every lesson, test and benchmark needs N processes that form one process group. Starting
them with ``spawn`` costs seconds of ``import torch`` per rank; ``fork`` costs tens of
milliseconds, so ranks here are forked (explicitly: Python 3.14 changes the default).

The rules that keep a failing run from hanging or leaving orphans:

* each rank dies with its parent (``PR_SET_PDEATHSIG``), so a killed test leaves nothing behind;
* the process group has a short timeout, shorter than the parent's, so a collective that one
  rank skipped fails inside the ranks with torch's own message first;
* the first rank that raises sends its traceback to the parent, which kills every rank and
  raises :class:`RankError` naming that rank (the likeliest cause, not a bystander);
* a rank that dies without a word (segfault, SIGKILL, an abort inside gloo) is reported with
  its exit code and the last lines it wrote to stderr (``miniddp.launch.rank_files``);
* past the parent's deadline the ranks still running dump their Python stacks (faulthandler)
  into the error, then are killed.

:class:`RankGroup` keeps its ranks (and their process group) alive across many calls, which
is what makes hundreds of distributed test cases affordable. Its files live in
``$TMPDIR/miniddp-<parent pid>-*`` (``miniddp.launch.rank_files``: what SIGKILL leaves is
removed later).
Functions and arguments travel by pickle, so functions must be importable at module level.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import math
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from miniddp.launch.rank_files import StderrTail, remove_stale_group_dirs
from miniddp.torch_versions import DESTROY_HOLDS_THE_GIL


class RankError(RuntimeError):
    """A rank raised, died or timed out. ``rank`` says which one."""

    def __init__(self, rank: int, world_size: int, what: str, details: str):
        self.rank, self.world_size, self.details = rank, world_size, details
        super().__init__(f"rank {rank} of {world_size} {what}:\n{details}")


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _send(conn, message) -> None:
    try:
        payload = pickle.dumps(message)
    except Exception as exc:  # an unpicklable result must not look like a hang
        payload = pickle.dumps(("error", f"result could not be pickled: {exc!r}"))
    conn.send_bytes(payload)


def _rank_main(rank, world_size, conn, store_path, backend, pg_timeout, stack_path, threads,
               stderr_fd):
    """The life of one forked rank: join the group, run tasks until told to stop."""
    _die_with_parent()
    os.dup2(stderr_fd, 2)  # the parent shows it, and keeps the tail in case this rank dies
    os.close(stderr_fd)
    if faulthandler.is_enabled():  # (pytest enables it on a copy of fd 2): into the tail too
        faulthandler.enable(file=sys.stderr, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills us
    for name in ("SIGTERM", "SIGHUP"):  # whatever handler the parent had: die as by default
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    torch.set_num_threads(threads)
    with open(stack_path, "w") as stack_file:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        try:
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout))
        except BaseException:
            _send(conn, ("error", traceback.format_exc()))
            os._exit(1)
        while True:
            try:
                task = pickle.loads(conn.recv_bytes())  # a function defined after the fork
                if task is None:                         # fails here: report it too
                    break
                fn, args, kwargs = task
                _send(conn, ("ok", fn(*args, **kwargs)))
            except BaseException:
                _send(conn, ("error", traceback.format_exc()))
        leave_group()  # not a bare destroy: older torch can deadlock there (see leave_group)
    conn.close()
    os._exit(0)


def leave_group() -> None:
    """Destroy the process group, after collecting garbage that may still hold it.

    Wrappers such as torch's DDP can keep a process group alive in a reference cycle; freed at
    interpreter exit instead, its threads are torn down too late ("terminate called without an
    active exception", SIGABRT), or its destructor deadlocks on the GIL (pytorch issue 56297).
    Where torch's destructor holds the GIL (:data:`miniddp.torch_versions.DESTROY_HOLDS_THE_GIL`)
    a short sleep first lets gloo's threads finish with the GIL free.
    """
    gc.collect()
    if DESTROY_HOLDS_THE_GIL:
        time.sleep(0.2)
    dist.destroy_process_group()


class RankGroup:
    """``world_size`` forked ranks in one process group, kept alive between :meth:`run` calls.

    After any failure the group is closed (its state is unknowable); create a new one.
    """

    #: After the first failure, how long to wait for the other ranks' reports. A rank that
    #: dies makes its peers fail within milliseconds ("Connection reset by peer"); waiting a
    #: moment lets the error name the rank that failed first, not a bystander.
    GRACE_S = 1.0

    def __init__(self, world_size: int = 2, backend: str = "gloo", pg_timeout: float = 30.0,
                 threads: int = 1):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size, self.backend = world_size, backend
        # torch imports torch._dynamo lazily (DDP construction, optimizers): seconds of CPU in
        # every rank unless it is imported once here, before the fork.
        import torch._dynamo  # noqa: F401
        remove_stale_group_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"miniddp-{os.getpid()}-")
        ctx = mp.get_context("fork")
        self._procs, self._conns, self._stderr = [], [], []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            stderr_read, stderr_write = os.pipe()
            stack_path = os.path.join(self._dir, f"stack-{rank}.txt")
            proc = ctx.Process(
                target=_rank_main, name=f"miniddp-rank{rank}", daemon=True,
                args=(rank, world_size, child_end, os.path.join(self._dir, "store"), backend,
                      pg_timeout, stack_path, threads, stderr_write))
            proc.start()
            child_end.close()
            os.close(stderr_write)
            self._procs.append(proc)
            self._conns.append(parent_end)
            self._stderr.append(StderrTail(stderr_read))

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout: float | None = 120.0, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``timeout`` (seconds, or ``None`` for no limit) bounds the whole call.
        """
        if not self._procs:
            raise RuntimeError("this RankGroup is closed (a rank failed earlier); start a new one")
        try:
            if not self.alive:  # a rank died before this call, e.g. joining the group: say why
                self._collect(self.GRACE_S)
                raise RuntimeError("a rank of this RankGroup exited before the call")
            task = pickle.dumps((fn, args, kwargs))
            for conn in self._conns:
                conn.send_bytes(task)
            return self._collect(math.inf if timeout is None else timeout)
        except BaseException:
            self.close(kill=True)
            raise

    def _collect(self, timeout: float) -> list:
        results: dict[int, object] = {}
        failures: dict[int, tuple[str, str]] = {}  # rank -> (what happened, details)
        deadline = time.monotonic() + timeout
        by_conn = {conn: r for r, conn in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while len(results) + len(failures) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in results and r not in failures]
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel
                                                            for r in pending]
            by_stderr = {tail.fd: tail for tail in self._stderr if tail.fd is not None}
            left = deadline - time.monotonic()
            ready = wait(waitables + list(by_stderr),
                         timeout=None if left == math.inf else max(0.0, left))
            for fd in [obj for obj in ready if obj in by_stderr]:
                by_stderr[fd].drain()
                ready.remove(fd)
            if not ready and time.monotonic() < deadline:
                continue
            if not ready:
                if failures:
                    break
                raise RankError(pending[0], self.world_size,
                                f"did not finish within {timeout:.0f} s (still running: ranks "
                                f"{pending})", self._stacks(pending))
            for obj in ready:
                rank = by_conn.get(obj, by_sentinel.get(obj))
                if rank in results or rank in failures:
                    continue
                try:
                    status, value = pickle.loads(self._conns[rank].recv_bytes())
                except EOFError:  # its end of the pipe closed: the process is gone
                    self._procs[rank].join(1)
                    status, value = "died", self._death(rank)
                if status == "ok":
                    results[rank] = value
                else:
                    failures[rank] = ("raised" if status == "error" else "died without reporting",
                                      value)
            if failures:  # give the other ranks a moment to report, then blame the likeliest
                deadline = min(deadline, time.monotonic() + self.GRACE_S)
        if failures:
            silent = [r for r in range(self.world_size) if r not in results and r not in failures]
            if silent and all(what == "raised" and _peer_failure(details)
                              for what, details in failures.values()):
                # The others gave up waiting for ranks that are still busy: blame those.
                waited = "\n".join(f"rank {r} {what}: {details.strip().splitlines()[-1]}"
                                    for r, (what, details) in sorted(failures.items()))
                raise RankError(silent[0], self.world_size,
                                "stopped taking part (the others' collectives failed waiting)",
                                f"{self._stacks(silent)}\n{waited}")
            raise _root_cause(failures, self.world_size)
        return [results[r] for r in range(self.world_size)]

    def _death(self, rank: int) -> str:
        """The exit code of a rank that died without reporting, and its own last words."""
        code = self._procs[rank].exitcode
        text = f"exit code {code}"
        if code is not None and code < 0:
            text += f" ({signal.Signals(-code).name})" if -code in signal.valid_signals() else ""
        last = self._stderr[rank].last_lines()
        if last:
            text += f"\nthe last lines rank {rank} wrote to stderr:\n{last}"
        else:
            text += f"\n(rank {rank} wrote nothing to stderr)"
        return text

    def _stacks(self, ranks) -> str:
        """Ask hung ranks for their Python stacks, so a timeout says where each one was."""
        for r in ranks:
            if self._procs[r].is_alive():
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        parts = []
        for r in ranks:
            with open(os.path.join(self._dir, f"stack-{r}.txt")) as f:
                parts.append(f"--- rank {r} stack ---\n{f.read().strip() or '(no stack)'}")
        return "\n".join(parts)

    def close(self, kill: bool = False) -> None:
        """Stop every rank (politely unless ``kill``) and remove the group's files."""
        if not kill:
            for conn, proc in zip(self._conns, self._procs):
                if proc.is_alive():
                    try:
                        conn.send_bytes(pickle.dumps(None))
                    except OSError:
                        pass
            for proc in self._procs:
                proc.join(10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        for conn in self._conns:
            conn.close()
        for tail in self._stderr:
            tail.close()
        self._procs, self._conns, self._stderr = [], [], []
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(kill=exc[0] is not None)


# Errors that a rank raises because a *peer* failed or stalled, not because of its own code.
_PEER_FAILURE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                 "NCCL communicator was aborted", "Socket Timeout", "Timed out waiting",
                 "Application timeout caused pair closure", "timed out")


def _peer_failure(details: str) -> bool:
    return any(marker in details for marker in _PEER_FAILURE)


def _headline(what: str, details: str) -> str:
    """One line of a failure: a traceback's last line, a death's exit code."""
    lines = details.strip().splitlines() or [""]
    return lines[0] if what == "died without reporting" else lines[-1]


def _root_cause(failures: dict[int, tuple[str, str]], world_size: int) -> RankError:
    """The failure most likely to be the cause: a death, then an error of the rank's own."""
    def rank_key(rank):
        what, details = failures[rank]
        return (what != "died without reporting", _peer_failure(details), rank)

    culprit = min(failures, key=rank_key)
    what, details = failures[culprit]
    others = [f"rank {r} {failures[r][0]}: {_headline(*failures[r])}"
              for r in sorted(failures) if r != culprit]
    if others:
        details += "\n(then " + "; ".join(others) + ")"
    return RankError(culprit, world_size, what, details)
