"""Run training jobs as a user would (``python -m``, ``torchrun``): with deadlines, no orphans.

torchrun starts each worker in a session of its own, so killing torchrun's process group does
not reach them: :class:`Job` notes every descendant while the job is alive and kills each one's
process group too. Processes are known by (pid, start time), so a pid the system has given to a
new process since is never signalled.

``Job(..., fork=True)`` runs a ``python -m module`` / ``python -c code`` / ``python script.py``
command in a process forked from this one instead of a new interpreter (:class:`ForkedPython`):
the seconds of ``import torch`` are already paid, the rest is as ``python`` would do it. For a
process whose own imports are beside the point (torchrun's agent, a launcher that starts the
workers a test is about); the processes it starts are new interpreters as ever.

:func:`run_like_torchrun` runs a torchrun-style script on ranks forked from the test process:
torchrun's environment without torchrun's seconds of ``import torch`` per worker.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

import torch
import torch.distributed as dist
from forked_python import become_python, die_with_parent

from miniddp import train
from miniddp.launch import launch, start_methods

REPO = Path(__file__).resolve().parents[2]
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK")


def run_job(argv: list[str], timeout: float = 60.0, nproc: int = 2) -> list:
    """``python -m miniddp.train --nproc NPROC ARGV``, ranks forked from this process; a failing
    rank raises RankError (``main`` would print it and return 1)."""
    args = train.parse_args(argv)
    return launch(train.train, world_size=nproc, args=(args,), backend="gloo", timeout=timeout,
                  pg_timeout=args.timeout)


def _main_in_child(argv: list[str], log: str) -> None:
    os.setpgrp()  # a process group of its own, as a shell gives a job: Ctrl-C reaches its ranks
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout, sys.stderr = os.fdopen(1, "w", buffering=1), os.fdopen(2, "w", buffering=1)
    code = train.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkedMain:
    """``python -m miniddp.train ARGV`` as a process forked from this one: the same launcher
    (``main``), its signals and exit code, without the seconds a new interpreter costs."""

    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self.proc = mp.get_context("fork").Process(target=_main_in_child, args=(argv, str(log)))
        self.proc.start()
        self.pid = self.proc.pid

    def running(self) -> bool:
        return self.proc.is_alive()

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait(self, timeout: float) -> int:
        """The exit code (negative: killed by that signal); past ``timeout``, kill and fail."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
            raise AssertionError(f"the job did not finish within {timeout:.0f} s; output:\n"
                                 f"{self.output()[-6000:]}")
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            os.killpg(self.pid, signal.SIGKILL)  # the launcher and its ranks
        self.proc.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


class RecordingDataset(torch.utils.data.TensorDataset):
    """The job's dataset, writing each batch's sample indices to ``DIR/<label>-rank<R>.txt``.

    Set ``label`` before each run. With ``num_workers=0`` the loader fetches a batch right before
    the step that trains on it, so line k of a rank's file is the batch of its k-th step.
    """

    def __init__(self, dataset, directory: Path):
        super().__init__(*dataset.tensors)
        self.directory, self.label = directory, "run"

    def __getitems__(self, indices):
        path = self.directory / f"{self.label}-rank{dist.get_rank()}.txt"
        with open(path, "a") as f:
            f.write(" ".join(map(str, indices)) + "\n")
        return [self[i] for i in indices]

    def batches(self, label: str, rank: int) -> list[list[int]]:
        path = self.directory / f"{label}-rank{rank}.txt"
        return [[int(i) for i in line.split()] for line in path.read_text().splitlines()]


def weights(path) -> dict:
    return torch.load(path, weights_only=True)


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's variables, one thread per rank, gloo on loopback."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env["OMP_NUM_THREADS"] = "1"
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update(extra)
    return env


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.1", *args]


def free_port() -> int:
    """A port free a moment ago (racy; only for torchrun's --rdzv-endpoint, which needs one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state is [0], start time [19])."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _descendants(pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process below ``pid``: the start time tells a reused pid."""
    children = defaultdict(list)
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields:
            children[int(fields[1])].append((int(entry), fields[19]))
    found, todo = set(), [pid]
    while todo:
        for child in children[todo.pop()]:
            found.add(child)
            todo.append(child[0])
    return found


def identity(pid: int) -> tuple[int, str]:
    """(pid, start time) of a running process; a start time of "" when it has gone."""
    fields = _stat(pid)
    return pid, fields[19] if fields else ""


def alive(process: tuple[int, str]) -> bool:
    """Whether this very process (not a later one with its pid) still runs."""
    fields = _stat(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


def _python_in_child(args: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)  # stdout and stderr, as Job's Popen has them
    become_python(args, cwd, env, fd, fd, own_session=True)


class ForkedPython:
    """``subprocess.Popen([sys.executable, *ARGS], ...)``'s part that :class:`Job` uses (``pid``,
    ``poll``, ``wait``, ``returncode``), for a ``python`` forked from this process: it costs
    no new interpreter, and already has what this process imported (torch, miniddp).

    Only where a forked child can run what the job runs (``start_methods.fork_is_safe``: no
    CUDA context, no autograd device threads here); :class:`Job` starts an interpreter instead.
    """

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str], log: Path):
        if (command[0] != sys.executable or len(command) < 2
                or command[1].startswith("-") and command[1] not in ("-m", "-c")):
            raise ValueError(f"ForkedPython runs `{sys.executable} -m MODULE | -c CODE | SCRIPT "
                             f"[ARGS]`, not {command}")
        self._process = mp.get_context("fork").Process(
            target=_python_in_child, args=(command[1:], str(cwd), dict(env), str(log)))
        self._process.start()
        self.pid, self.returncode = self._process.pid, None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(["python", "(forked)"], timeout)
        return self.returncode


class Job:
    """A command in a new session, its output in a file; killed with all it started on failure.

    ``fork=True``: a ``python`` command runs in a process forked from this one
    (:class:`ForkedPython`) where that is safe, in a new interpreter where it is not.
    """

    #: Seconds between two looks for the job's descendants: each look reads every process's
    #: /proc/PID/stat (milliseconds of CPU), and a worker lives for seconds.
    SCAN_EVERY = 0.25

    def __init__(self, command: list[str], log: Path, cwd: Path | None = None,
                 env: dict[str, str] | None = None, fork: bool = False):
        self.command, self.log_path = command, log
        self._log = open(log, "w")
        cwd, env = cwd or REPO, env or clean_env()
        if fork and command[0] == sys.executable and start_methods.fork_is_safe():
            self.proc = ForkedPython(command, cwd, env, log)
        else:
            self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self._seen: set[tuple[int, str]] = set()
        self._scanned = 0.0

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def running(self) -> bool:
        if self.proc.poll() is None:
            if time.monotonic() - self._scanned >= self.SCAN_EVERY:
                self._seen.update(_descendants(self.proc.pid))
                self._scanned = time.monotonic()
            return True
        return False

    def wait(self, timeout: float) -> int:
        """Wait for the exit code; past ``timeout`` kill everything and fail with the output."""
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{' '.join(self.command)} did not finish within "
                                     f"{timeout:.0f} s; output:\n{self.output()[-6000:]}")
            time.sleep(0.05)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the job's process group and every descendant's (workers have their own)."""
        if self.proc.poll() is None:
            self._seen.update(_descendants(self.proc.pid))
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in self._seen:
            if alive(process):
                for kill in (os.killpg, os.kill):
                    try:
                        kill(process[0], signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()  # a no-op for a job that ended; a failed test leaves nothing behind
        self._log.close()
        deadline = time.monotonic() + 5
        while any(alive(p) for p in self._seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = sorted(p[0] for p in self._seen if alive(p))
        assert not left, f"processes left behind by {' '.join(self.command)}: {left}"


def run(command: list[str], log: Path, timeout: float, **kwargs) -> tuple[int, str]:
    """Run a job to the end: (exit code, output). ``kwargs``: :class:`Job`'s."""
    with Job(command, log, **kwargs) as job:
        code = job.wait(timeout)
        return code, job.output()


def _script_rank(script: str, argv: list[str], env: dict[str, str], error_file: str,
                 stdout: Connection, stderr: Connection) -> None:
    die_with_parent()
    for fd, end in ((1, stdout), (2, stderr)):  # the test's own, also from a forkserver
        os.dup2(end.fileno(), fd)
        end.close()
    os.environ.update(env)
    sys.argv = [script, *argv]
    with open(error_file + ".stack", "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            runpy.run_path(script, run_name="__main__")
        except BaseException:
            Path(error_file).write_text(traceback.format_exc())
            raise


def _stacks(procs, errors) -> str:
    """The Python stacks of the ranks still running (each dumps its own on SIGUSR1)."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(0.5)
    return "\n".join(f"--- rank {r} ---\n" + Path(f"{errors[r]}.stack").read_text()
                     for r, p in enumerate(procs) if p.is_alive())


def _host_store(conn, world_size: int) -> None:
    """Stand in for torchrun's agent: host the store the ranks meet in, until told to stop."""
    die_with_parent()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                          timeout=timedelta(seconds=60), wait_for_workers=False)
    conn.send(store.port)
    while True:
        time.sleep(3600)  # killed by the parent when the ranks are done, or with it


def run_like_torchrun(script: Path, argv: list[str], workdir: Path, world_size: int = 2,
                      timeout: float = 60.0) -> None:
    """Run a torchrun-style script on ``world_size`` ranks forked from this process.

    Each rank gets the variables torchrun would give it and, as under torchrun, meets the others
    in a store hosted by another process (no port to pick and race for, no ``import torch`` in
    a fresh interpreter per rank). The store's server runs a thread, so it lives in a process of
    its own: a process forked while another of its threads holds a lock can deadlock. The first
    rank that fails is named with its traceback, one that hangs with its stack; all are killed.
    """
    ctx = mp.get_context("fork")
    to_host, host_end = ctx.Pipe()
    host = ctx.Process(target=_host_store, args=(host_end, world_size), daemon=True)
    host.start()
    procs, errors = [], []
    try:
        assert to_host.poll(30), "the store host did not start within 30 s"
        common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(to_host.recv()),
                  "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                  "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
        # forked, unless a forked child could not run autograd (miniddp.launch.start_methods)
        rank_ctx = start_methods.context(start_methods.choose_start_method())
        for rank in range(world_size):
            errors.append(workdir / f"rank{rank}.err")
            env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            outputs = [Connection(os.dup(fd), readable=False) for fd in (1, 2)]
            procs.append(rank_ctx.Process(target=_script_rank, daemon=True,
                                          args=(str(script), argv, env, str(errors[-1]),
                                                *outputs)))
            procs[-1].start()
            for end in outputs:
                end.close()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                rank = failed[0]
                text = errors[rank].read_text() if errors[rank].exists() else "(no traceback)"
                raise AssertionError(f"{script.name} failed on rank {rank} (exit code "
                                     f"{procs[rank].exitcode}):\n{text}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{script.name} did not finish within {timeout:.0f} s; "
                                     f"where the ranks were:\n{_stacks(procs, errors)}")
            mp_wait([p.sentinel for p in procs if p.is_alive()], timeout=0.1)
        for rank, p in enumerate(procs):
            assert p.exitcode == 0, f"{script.name} failed on rank {rank}:\n" + (
                errors[rank].read_text() if errors[rank].exists() else "(no traceback)")
    finally:
        for p in [*procs, host]:  # the host's store would wait for its clients: no courtesy
            if p.is_alive():
                p.kill()
            p.join(5)
        to_host.close()
