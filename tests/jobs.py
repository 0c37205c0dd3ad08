"""Run training jobs as a user would (``python -m``, ``torchrun``): with deadlines, no orphans.

torchrun starts each worker in a session of its own, so killing torchrun's process group does
not reach them: :class:`Job` notes every descendant while the job is alive and kills each one's
process group too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK")


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


def alive(process: tuple[int, str]) -> bool:
    """Whether this very process (not a later one with its pid) still runs."""
    fields = _stat(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


class Job:
    """A command in a new session, its output in a file; killed with all it started on failure."""

    def __init__(self, command: list[str], log: Path, cwd: Path | None = None,
                 env: dict[str, str] | None = None):
        self.command, self.log_path = command, log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(command, cwd=cwd or REPO, env=env or clean_env(),
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._seen: set[tuple[int, str]] = set()

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def running(self) -> bool:
        if self.proc.poll() is None:
            self._seen.update(_descendants(self.proc.pid))
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
    """Run a job to the end: (exit code, output)."""
    with Job(command, log, **kwargs) as job:
        code = job.wait(timeout)
        return code, job.output()
