"""``python script.py args`` without paying ``import torch`` each time: a warm interpreter forks.

Tests that run a script dozens of times (the grader on each wrong solution, a lesson with each
breakage) spent most of each run starting Python: ``import torch`` and ``torch._dynamo`` are
about 2.5 s of CPU, before the script does anything. Here one interpreter, started once, imports
them (and nothing else runs in it: no tensor op, no thread, no backward), then forks a fresh child
for each run, which becomes ``python script.py args`` (``forked_python.become_python``: the
``sitecustomize`` of the ``PYTHONPATH`` it is given runs, which is how ``tests/support/breakage``
breaks a mechanism; stdout and stderr go to pipes read to their end, as ``subprocess.run``
reads them). Each run starts from the warm interpreter's untouched state, never from another
run's, so one verdict cannot leak into the next.

What such a child has that a fresh interpreter would not: the modules named in ``preload``
already imported, before any ``sitecustomize`` of its own runs. A breakage aimed at one of them
is applied at once instead of on import (``tests/support/breakage/breakages.py`` does either):
preload torch only, not the code that the breakages patch. ``tests/course/test_lessons.py`` runs
each lesson's plain command here too; a fresh interpreter still starts each torchrun worker
there and the lesson that ``run_course.py`` runs for real.

    warm = WarmPython(["torch", "torch._dynamo"])
    done = warm.run([sys.executable, "lessons/00_one_process.py"], env=..., cwd=..., timeout=120)
    # done is a subprocess.CompletedProcess; subprocess.TimeoutExpired past the timeout
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from forked_python import become_python

# ----- the parent's side: in the test process -----


class WarmPython:
    """One warm interpreter that runs scripts, one at a time, each in a forked child.

    A run that times out kills the warm interpreter and the child (the child dies with it); the
    next run starts a new one, as a fresh interpreter would be for each ``subprocess.run``. Runs
    asked for from two threads at once (a test, and a run started ahead of the next test on the
    same slot) take turns: the requests and replies share one pipe each.
    """

    def __init__(self, preload: list[str], path: str | None = None,
                 env: dict[str, str] | None = None):
        self.preload, self.path, self.env = list(preload), path, env
        self._proc: subprocess.Popen | None = None
        self._turn = threading.Lock()

    def _start(self) -> subprocess.Popen:
        command = [sys.executable, __file__, *(["--path", self.path] if self.path else []),
                   *self.preload]
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=self.env)

    def run(self, argv: list[str], env: dict[str, str], cwd: str | Path,
            timeout: float) -> subprocess.CompletedProcess:
        """Like ``subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
        timeout=timeout)``, where ``argv`` is ``[python, script, *args]``."""
        if argv[0] != sys.executable or len(argv) < 2 or argv[1].startswith("-"):
            raise ValueError(f"WarmPython runs `{sys.executable} script.py ...`, not {argv}")
        with self._turn:
            return self._run(argv, env, cwd, timeout)

    def _run(self, argv, env, cwd, timeout) -> subprocess.CompletedProcess:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        with tempfile.TemporaryDirectory(prefix="warm-python-") as outputs:
            out, err = os.path.join(outputs, "stdout"), os.path.join(outputs, "stderr")
            request = {"argv": [str(a) for a in argv], "env": dict(env), "cwd": str(cwd),
                       "stdout": out, "stderr": err}
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            reply = self._read_reply(timeout)
            if reply is None:
                self.close()
                raise subprocess.TimeoutExpired(argv, timeout, *self._outputs(out, err))
            stdout, stderr = self._outputs(out, err)
        return subprocess.CompletedProcess(argv, reply["returncode"], stdout, stderr)

    def _read_reply(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self._proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the warm interpreter exited ({self._proc.wait()}) "
                                   "before it answered")
            line += chunk
        return json.loads(line)

    @staticmethod
    def _outputs(out: str, err: str) -> tuple[str, str]:
        read = lambda p: Path(p).read_text(errors="replace") if os.path.exists(p) else ""
        return read(out), read(err)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()  # its child (the script) dies with it
            self._proc.wait()
        self._proc = None


#: What the interpreter that forks a lesson's run imports: the modules every lesson imports
#: first, never the modules that the breakages patch (see above)
LESSON_PRELOAD = ("torch", "torch._dynamo")

_shared: dict[tuple, WarmPython] = {}


def warm_python(preload: tuple[str, ...], path: str | None = None, slot: int = 0) -> WarmPython:
    """The warm interpreter with these preloads, shared by the tests of this pytest process;
    another ``slot`` is another such interpreter, to run two scripts at once."""
    key = (preload, path, slot)
    if key not in _shared:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        _shared[key] = WarmPython(list(preload), path, env)
    return _shared[key]


@atexit.register
def _close_all() -> None:
    for warm in _shared.values():
        warm.close()


# ----- the warm interpreter's side -----


def _serve(path: str | None, preload: list[str]) -> None:
    # Not die_with_parent() here: Linux sends that signal when the *thread* that started this
    # process ends (a pool thread of tests/support/runs_ahead.py may have). Without the test process
    # this interpreter reads the end of its requests and exits; a script it is running has the
    # signal (this process is single-threaded) and its own timeouts.
    if path:
        sys.path[0] = path
    for name in preload:
        __import__(name)
    requests = os.fdopen(0, "rb", buffering=0)
    while line := requests.readline():
        request = json.loads(line)
        pid, status = _run_in_child(request)
        reply = {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}
        os.write(1, (json.dumps(reply) + "\n").encode())


def _run_in_child(request: dict) -> tuple[int, int]:
    """Fork; the child runs the script, this side copies its output to the files named."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(out_read)
        os.close(err_read)
        become_python(request["argv"][1:], request["cwd"], request["env"], out_write, err_write,
                      own_session=False)  # never returns
    os.close(out_write)
    os.close(err_write)
    files = {out_read: open(request["stdout"], "wb", buffering=0),  # seen even after a timeout
             err_read: open(request["stderr"], "wb", buffering=0)}
    while files:  # to the end of both pipes, as subprocess.run reads them (grandchildren too)
        for fd in select.select(list(files), [], [])[0]:
            chunk = os.read(fd, 65536)
            if chunk:
                files[fd].write(chunk)
            else:
                files.pop(fd).close()
                os.close(fd)
    return pid, os.waitpid(pid, 0)[1]


if __name__ == "__main__":
    arguments = sys.argv[1:]
    where = None
    if arguments[:1] == ["--path"]:
        where, arguments = arguments[1], arguments[2:]
    _serve(where, arguments)
