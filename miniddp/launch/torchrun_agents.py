"""Start torchrun agents from a script, relay what they print, and leave nothing behind.

Lessons 09 and 12 show torchrun at work. Run plainly, each starts torchrun itself (one agent, or
one per simulated node) on its own file, which then runs again as torchrun's workers. Doing
that safely is plumbing, kept here so that the lessons read as their idea:

* **a clean environment.** An agent gets this process's environment without the variables of
  a launcher that may have started this process (``RANK``, ``TORCHELASTIC_*``...), with
  ``PYTHONUNBUFFERED=1`` so that lines arrive as they are printed, and ``OMP_NUM_THREADS=1``.
  About that one: when torchrun starts more than one worker per node and finds no
  ``OMP_NUM_THREADS``, it sets it to 1 for every worker and prints a banner of asterisks saying
  so ("Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to
  avoid your system being overloaded..."). The reason is sound: each worker would otherwise run
  one compute thread per core, and N workers would fight over the cores. Setting it ourselves,
  to the same 1, keeps the banner out of the lesson; on a real node use about
  cores / workers.
* **every line relayed at once**, prefixed with the agent's name, and kept for the verdict.
* **a deadline.** Past it, or a few seconds after one agent failed (the others then fail too,
  or wait for ever at the rendezvous), every agent is stopped: SIGTERM to its process group,
  on which torchrun stops its workers, then SIGKILL if it does not stop.
* **no orphans.** Agents get SIGTERM when this process dies, however it dies, and
  :func:`as_worker` makes each worker die with its agent (Linux's ``PR_SET_PDEATHSIG``).
* **a failure that names its rank.** :func:`as_worker` prints ``rank R of W raised:`` before a
  worker's traceback, as the ranks that :mod:`miniddp.launch` forks do, so that whoever reads
  the output (``lessons/run_course.py``) finds the failed check and its rank under torchrun's
  own report.

This module imports no torch: a script that only starts agents does not pay for it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

#: What torchrun tells its workers; the test ``miniddp.launch.launched_by_torchrun`` makes.
WORKER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_VARIABLES = WORKER_VARIABLES + ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                         "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE")


def started_by_torchrun() -> bool:
    """True in a worker that torchrun (or a launcher using its variables) started."""
    return all(k in os.environ for k in WORKER_VARIABLES)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: receive ``sig`` when the parent process dies, however it dies."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, sig)


def as_worker(main: Callable[[], object]) -> object:
    """Run ``main`` in a worker: die with the agent; on an error, name this rank, then raise."""
    die_with_parent(signal.SIGKILL)
    try:
        return main()
    except BaseException as error:
        if not isinstance(error, SystemExit):  # an exit on purpose has said why already
            print(f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} "
                  f"raised:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise


def torchrun(*arguments: str) -> list[str]:
    """The command that runs torchrun with ``arguments`` under this Python."""
    return [sys.executable, "-m", "torch.distributed.run", *arguments]


def shown(command: list[str]) -> str:
    """A torchrun command as a person would type it."""
    return "torchrun " + " ".join(command[3:])


def free_port() -> int:
    """A port nobody listens on right now (another program may still take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_environment() -> dict[str, str]:
    """This process's environment for a fresh agent (see the module docstring)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return env


@dataclass
class AgentsDone:
    """How the agents ended: exit statuses (negative: killed by that signal) and outputs."""

    codes: list[int]
    outputs: list[str]
    stopped: str = ""  # why they were stopped, if they were
    ok_lines: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(self.codes)


def _stop(agents: list[subprocess.Popen], patience: float = 15.0) -> None:
    """SIGTERM each agent's process group (torchrun then stops its workers); SIGKILL later."""
    for agent in agents:
        if agent.poll() is None:
            try:
                os.killpg(agent.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + patience
    for agent in agents:
        try:
            agent.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


def run_agents(commands: list[list[str]], prefixes: list[str], timeout: float,
               grace: float = 5.0) -> AgentsDone:
    """Run one torchrun agent per command, relaying each line with its prefix, until all end.

    Past ``timeout`` seconds, or ``grace`` seconds after an agent failed, the agents still
    running are stopped with their workers. The result holds every agent's exit status and
    output, and the lines its workers printed that start with ``OK:``.
    """
    env = agent_environment()
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True,
                               preexec_fn=lambda: die_with_parent(signal.SIGTERM))
              for command in commands]
    outputs: list[list[str]] = [[] for _ in agents]

    def relay(i: int) -> None:
        for line in agents[i].stdout:
            outputs[i].append(line)
            print(f"{prefixes[i]}{line}", end="", flush=True)

    relays = [threading.Thread(target=relay, args=(i,), daemon=True) for i in range(len(agents))]
    for thread in relays:
        thread.start()
    deadline, give_up, stopped = time.monotonic() + timeout, None, ""
    try:
        while any(agent.poll() is None for agent in agents):
            failed = any(agent.poll() not in (None, 0) for agent in agents)
            if failed and give_up is None:
                give_up = time.monotonic() + grace
            if time.monotonic() > deadline or (give_up and time.monotonic() > give_up):
                stopped = "one failed" if failed else f"still running after {timeout:.0f} s"
                print(f"stopping torchrun: {stopped}", flush=True)
                break
            time.sleep(0.05)
    finally:
        _stop(agents)
        for thread in relays:
            thread.join(5)
    texts = ["".join(lines) for lines in outputs]
    said = [line for text in texts for line in text.splitlines() if line.startswith("OK:")]
    return AgentsDone([agent.returncode for agent in agents], texts, stopped, said)


def verdict(done: AgentsDone, expected: str = "") -> str:
    """The workers' one ``OK:`` line, or exit naming what went wrong (their output is above)."""
    if done.failed:
        sys.exit(f"FAILED: torchrun exited with status {done.codes} (negative: stopped by that "
                 "signal); the output above says which rank failed and why")
    if len(done.ok_lines) != 1 or expected not in done.ok_lines[0]:
        sys.exit(f"FAILED: expected one OK line from the workers' rank 0"
                 f"{f' saying {expected!r}' if expected else ''}, got {done.ok_lines}")
    return done.ok_lines[0]
