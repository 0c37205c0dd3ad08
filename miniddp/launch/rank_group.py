"""Forked ranks in one process group: the machinery under ``miniddp.launch``.

Every lesson, test and benchmark needs N processes that form one process group. Starting
them with ``spawn`` costs seconds of ``import torch`` per rank; ``fork`` costs tens of
milliseconds, so ranks here are forked (explicitly: Python 3.14 changes the default), unless
this process has done something after which a forked child cannot run autograd (a backward on a
machine with a GPU): then they start from a forkserver (``miniddp.launch.start_methods``).

The rules that keep a failing run from hanging or leaving orphans:

* each rank dies with its parent (``PR_SET_PDEATHSIG``), so a killed test leaves nothing behind
  (a forkserver's ranks die with the server, which exits when this process does);
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

One module because it is one protocol, both ends of it: what a rank sends
(``_rank_main``) and how the parent reads it (:class:`RankGroup`), with the wording of a
failure (``_root_cause``, ``_advice``) that only that reading produces. Where the ranks start
and where their files live are modules of their own (``start_methods``, ``rank_files``).
"""

from __future__ import annotations

import faulthandler
import gc
import math
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from miniddp.launch.rank_files import StderrTail, remove_stale_group_dirs
from miniddp.launch.start_methods import (
    AUTOGRAD_FORK_ERROR,
    choose_start_method,
    context,
    die_with_parent,
    dumps_task,
    loads_task,
)
from miniddp.torch_versions import DESTROY_HOLDS_THE_GIL, INDUCTOR_STARTS_WORKERS_ON_IMPORT


class RankError(RuntimeError):
    """A rank raised, died or timed out. ``rank`` says which one."""

    def __init__(self, rank: int, world_size: int, what: str, details: str):
        self.rank, self.world_size, self.details = rank, world_size, details
        super().__init__(f"rank {rank} of {world_size} {what}:\n{details}")


def _send(conn, message) -> None:
    try:
        payload = pickle.dumps(message)
    except Exception as exc:  # an unpicklable result must not look like a hang
        payload = pickle.dumps(("error", f"result could not be pickled: {exc!r}"))
    conn.send_bytes(payload)


def _rank_main(rank, world_size, conn, store_path, backend, pg_timeout, stack_path, threads,
               stdout: Connection, stderr: Connection, parent_faulthandler: bool):
    """The life of one rank: join the group, run tasks until told to stop."""
    die_with_parent()
    os.dup2(stdout.fileno(), 1)  # the parent's stdout now (a forkserver's is from its start)
    stdout.close()
    os.dup2(stderr.fileno(), 2)  # the parent shows it, and keeps the tail in case this rank dies
    stderr.close()
    if parent_faulthandler:  # (pytest enables it on a copy of fd 2): into the tail too
        faulthandler.enable(file=sys.stderr, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills us
    for name in ("SIGTERM", "SIGHUP"):  # whatever handler the parent had: die as by default
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    torch.set_num_threads(threads)
    if INDUCTOR_STARTS_WORKERS_ON_IMPORT:  # a daemonic process may not start them
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        if "torch._inductor.config" in sys.modules:
            sys.modules["torch._inductor.config"].compile_threads = 1
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
                task = loads_task(conn.recv_bytes())  # a function defined after the fork
                if task is None:                       # fails here: report it too
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
    if not dist.is_initialized():  # the rank's function destroyed it itself, as torch's
        return                       # tutorials' cleanup() does
    gc.collect()
    if DESTROY_HOLDS_THE_GIL:
        time.sleep(0.2)
    dist.destroy_process_group()


class RankGroup:
    """``world_size`` ranks in one process group, kept alive between :meth:`run` calls.

    ``start_method``: ``None`` forks them where a forked child can run autograd and starts them
    from a forkserver where it cannot (:func:`miniddp.launch.start_methods.choose_start_method`);
    ``"fork"`` or ``"forkserver"`` insists. After any failure the group is closed (its state is
    unknowable); create a new one.
    """

    #: After the first failure, how long to wait for the other ranks' reports. A rank that
    #: dies makes its peers fail within milliseconds ("Connection reset by peer"); waiting a
    #: moment lets the error name the rank that failed first, not a bystander.
    GRACE_S = 1.0

    def __init__(self, world_size: int = 2, backend: str = "gloo", pg_timeout: float = 30.0,
                 threads: int = 1, start_method: str | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if start_method not in (None, "fork", "forkserver"):
            raise ValueError(f"start_method must be None, 'fork' or 'forkserver', got "
                             f"{start_method!r}")
        self.world_size, self.backend = world_size, backend
        self.start_method = start_method or choose_start_method()
        # torch imports torch._dynamo lazily (DDP construction, optimizers): seconds of CPU in
        # every rank unless it is imported once here, before the fork.
        import torch._dynamo  # noqa: F401
        remove_stale_group_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"miniddp-{os.getpid()}-")
        ctx = context(self.start_method)
        self._procs, self._conns, self._stderr = [], [], []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            stderr_read, stderr_write = os.pipe()
            # Connections travel to a rank under any start method (fds are passed along)
            stdout_end = Connection(os.dup(1), readable=False)
            stderr_end = Connection(stderr_write, readable=False)
            stack_path = os.path.join(self._dir, f"stack-{rank}.txt")
            proc = ctx.Process(
                target=_rank_main, name=f"miniddp-rank{rank}", daemon=True,
                args=(rank, world_size, child_end, os.path.join(self._dir, "store"), backend,
                      pg_timeout, stack_path, threads, stdout_end, stderr_end,
                      faulthandler.is_enabled()))
            try:
                proc.start()
            except BaseException as error:
                os.close(stderr_read)
                self.close(kill=True)
                if self.start_method == "fork" or not isinstance(error, (EOFError, OSError)):
                    raise
                raise RuntimeError(f"could not start rank {rank} from a forkserver "
                                   f"({error!r}). {FORKSERVER_ADVICE}") from error
            finally:
                child_end.close()
                stdout_end.close()
                stderr_end.close()
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
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, or None for no limit; "
                             f"got {timeout!r}")
        try:
            if not self.alive:  # a rank died before this call, e.g. joining the group: say why
                self._collect(self.GRACE_S)
                raise RuntimeError("a rank of this RankGroup exited before the call")
            task = dumps_task((fn, args, kwargs), self.start_method)
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(task)
                except OSError as error:  # BrokenPipeError, ConnectionResetError: it is gone
                    raise RankError(rank, self.world_size, "died without reporting",
                                    self._broken_pipe(rank, "sending it the task", error)
                                    ) from error
            return self._collect(math.inf if timeout is None else timeout)
        except BaseException:
            self.close(kill=True)
            raise

    def _collect(self, timeout: float) -> list:
        results: dict[int, object] = {}
        failures: dict[int, tuple[str, str]] = {}  # rank -> (what happened, details)
        causes: dict[int, OSError] = {}  # rank -> the error its pipe raised, if it raised one
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
                                f"did not finish within {timeout:g} s (still running: ranks "
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
                except OSError as error:  # reset or broken mid-message: gone too, or as good as
                    causes[rank] = error
                    status, value = "died", self._broken_pipe(rank, "reading its report", error)
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
            error = _root_cause(failures, self.world_size, self.start_method)
            if error.rank in causes:  # the pipe's own error stays visible, as the cause
                raise error from causes[error.rank]
            raise error
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

    def _broken_pipe(self, rank: int, doing: str, error: OSError) -> str:
        """The details of a rank whose pipe failed (reset, broken) rather than closing cleanly.

        A rank that dies part way through a message, or whose socket is reset, surfaces here as
        an OSError rather than an EOFError; it is the same news, and must name the rank too.
        """
        self._procs[rank].join(1)
        if self._procs[rank].exitcode is None:  # alive, but unreachable: close() will kill it
            return (f"its pipe to the parent failed while {doing} ({error!r}), although it was "
                    f"still running; it is killed with the group")
        return f"its pipe to the parent failed while {doing} ({error!r}); {self._death(rank)}"

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
                        conn.send_bytes(dumps_task(None, "fork"))
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


def _root_cause(failures: dict[int, tuple[str, str]], world_size: int,
                start_method: str = "fork") -> RankError:
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
    return RankError(culprit, world_size, what, details + _advice(what, details, start_method))


FORK_ADVICE = (
    "miniddp: this rank was forked from a process that had already run a backward on a machine "
    "with a GPU; torch forbids autograd in such a fork. Leave RankGroup's start_method unset "
    "(miniddp.launch then starts ranks from a forkserver when it must), launch the ranks "
    "before the first backward, or start them with torchrun.")
FORKSERVER_ADVICE = (
    "miniddp started these ranks from a forkserver, because a child forked from this process "
    "could not run autograd (it had run a backward on a machine with a GPU, or initialized "
    "CUDA). A forkserver imports the main script again: put its top-level code under "
    "`if __name__ == \"__main__\":` and define the functions sent to ranks at the top level of "
    "a file (not in `python -c`, a notebook or an interactive session). Or launch the ranks "
    "before the first backward, or start them with torchrun.")
_NOT_FOUND_IN_RANK = ("Can't get attribute", "No module named", "ModuleNotFoundError")


def _advice(what: str, details: str, start_method: str) -> str:
    """What to do, for the two failures that come from how the ranks were started."""
    if AUTOGRAD_FORK_ERROR in details:
        return "\n" + FORK_ADVICE
    if start_method != "fork" and (what == "died without reporting"
                                   or any(s in details for s in _NOT_FOUND_IN_RANK)):
        return "\n" + FORKSERVER_ADVICE
    return ""
