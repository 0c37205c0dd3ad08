"""miniddp.launch.torchrun_agents: agents relayed line by line, stopped on time, failures named
by rank.

The agents here are tiny Python commands standing in for torchrun, so each test takes well under
a second; lessons 09 and 12 run the real thing (tests/course/test_lessons.py).
"""

import os
import signal
import sys
import time

import jobs
import pytest

from miniddp.launch.torchrun_agents import AgentsDone, agent_environment, run_agents, verdict


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_each_line_is_relayed_with_its_agents_prefix_and_ok_lines_are_collected(capsys):
    done = run_agents([python("print('hello'); print('OK: done')"), python("print('second')")],
                      ["[a] ", "[b] "], timeout=30)
    out = capsys.readouterr().out
    assert "[a] hello\n" in out and "[a] OK: done\n" in out and "[b] second\n" in out
    assert done.codes == [0, 0] and not done.failed and done.ok_lines == ["OK: done"]


def test_the_others_are_stopped_soon_after_one_agent_fails():
    start = time.monotonic()
    done = run_agents([python("import sys; sys.exit(3)"),
                       python("import time; time.sleep(60)")], ["", ""], timeout=60, grace=0.5)
    assert time.monotonic() - start < 20
    assert done.codes == [3, -signal.SIGTERM] and done.stopped == "one failed"


def test_agents_still_running_past_the_deadline_are_stopped():
    start = time.monotonic()
    done = run_agents([python("import time; print('started', flush=True); time.sleep(60)")],
                      [""], timeout=1)
    assert time.monotonic() - start < 20
    assert done.codes == [-signal.SIGTERM] and "still running" in done.stopped
    assert done.outputs == ["started\n"]


def test_agents_get_no_launcher_variables_and_one_thread(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = agent_environment()
    assert "RANK" not in env and "TORCHELASTIC_RESTART_COUNT" not in env
    assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"


def test_a_failing_worker_names_its_rank_before_its_traceback(tmp_path):
    """The worker is ``python -c`` forked from this process (``jobs.Job``'s ``fork``: no
    seconds of ``import torch``); it exits as Python exits on an uncaught exception."""
    code = "from miniddp.launch.torchrun_agents import as_worker; as_worker(lambda: 1 / 0)"
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    status, output = jobs.run(python(code), tmp_path / "worker.log", timeout=60, env=env,
                              fork=True)  # stdout and stderr: the worker writes to stderr only
    assert status == 1, output
    assert output.startswith("rank 1 of 2 raised:\nTraceback"), output
    assert "ZeroDivisionError" in output


def test_the_verdict_is_the_workers_ok_line_or_an_exit_saying_what_went_wrong():
    assert verdict(AgentsDone([0], ["OK: fine\n"], ok_lines=["OK: fine"]), "fine") == "OK: fine"
    with pytest.raises(SystemExit, match=r"torchrun exited with status \[1\]"):
        verdict(AgentsDone([1], [""]))
    with pytest.raises(SystemExit, match="expected one OK line"):
        verdict(AgentsDone([0], [""], ok_lines=[]))
