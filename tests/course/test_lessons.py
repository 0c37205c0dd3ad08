"""Every lesson runs end to end and proves itself; run_course.py tells a failing lesson apart.

Lessons are found by glob, so a new ``lessons/NN_topic.py`` is tested without touching this file.
Select them with ``pytest -m lesson``; the fast tier (``-m "not slow"``, ``tests/conftest.py``)
runs lesson 08 alone.

``python lessons/NN_topic.py`` runs in a warm interpreter (``tests/support/warm_python.py``: a fork
of
one that imported torch, which is otherwise most of a short lesson's CPU), and the documented
torchrun command runs as it is, in fresh interpreters, for each lesson whose code does
something of its own under torchrun (it asks ``launched_by_torchrun()``). A lesson that asks
``started_by_torchrun()`` is a torchrun worker: run plainly, it starts torchrun on its own file
(``--standalone``, or agents meeting at a rendezvous) and checks its workers' OK, so its plain run
is already that torchrun run. The others reach torchrun only through ``miniddp.launch``, the same
code for every lesson, which those runs and ``tests/operations/test_launch.py`` prove; for them the
test
checks that the command their docstring gives names the lesson's own file.
"""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lesson_modules import CANNOT_RUN_HERE, runnable_here
from runs_ahead import RunsAhead, selected
from warm_python import LESSON_PRELOAD, warm_python

LESSONS_DIR = Path(__file__).resolve().parents[2] / "lessons"
LESSONS = sorted(LESSONS_DIR.glob("[0-9][0-9]_*.py"))
TIMEOUT = 120


def learner_env(tmp_path) -> dict[str, str]:
    """This process's environment less torchrun's variables, figures kept in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["MINIDDP_RUNS"] = str(tmp_path / "runs")
    return env


def run(command, tmp_path, cwd=None, timeout=TIMEOUT, env=None):
    """Run a command the way a learner would, with figures kept out of the repository."""
    return subprocess.run(command, cwd=cwd or LESSONS_DIR.parent,
                          env=env or learner_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)


def last_line(done) -> str:
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def torchrun_command(lesson: Path):
    """The torchrun command a lesson's docstring gives, if it gives one."""
    found = re.search(r"^\s*(torchrun --standalone --nproc_per_node=2 \S+)", lesson.read_text(),
                      re.MULTILINE)
    return found.group(1).split() if found else None


def branches_under_torchrun(lesson: Path) -> bool:
    """Whether the lesson's own code does something else when torchrun started it."""
    return re.search(r"\b(launched|started)_by_torchrun\(\)", lesson.read_text()) is not None


def runs_torchrun_itself(lesson: Path) -> bool:
    """Whether the lesson is a torchrun worker that, run plainly, starts torchrun on itself."""
    return re.search(r"\bstarted_by_torchrun\(\)", lesson.read_text()) is not None


DOCUMENTED_TORCHRUN = [p for p in LESSONS if torchrun_command(p)]
TORCHRUN_LESSONS = [p for p in DOCUMENTED_TORCHRUN
                    if branches_under_torchrun(p) and not runs_torchrun_itself(p)]


def lesson_command(test_name: str, lesson: Path) -> list[str]:
    """The command whose run the test ``test_name`` checks, for ``lesson``."""
    if test_name == "test_lesson_runs_and_ends_with_ok":
        return [sys.executable, str(lesson)]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_command(lesson)[1:]]


@pytest.fixture(scope="module")
def runs_ahead(request, tmp_path_factory):
    """The selected tests' lesson runs, one test ahead, two at a time
    (``tests/support/runs_ahead.py``)."""
    for slot in (0, 1):
        warm_python(LESSON_PRELOAD, slot=slot)  # created here: it reads os.environ

    def prepared(item):
        lesson = item.callspec.params["lesson"]
        runs = tmp_path_factory.mktemp(lesson.stem)
        command, env = lesson_command(item.originalname, lesson), learner_env(runs)
        if item.originalname == "test_lesson_runs_and_ends_with_ok":
            return lambda slot: warm_python(LESSON_PRELOAD, slot=slot).run(
                command, env=env, cwd=LESSONS_DIR.parent, timeout=TIMEOUT)
        return lambda slot: run(command, runs, env=env)

    items = [item for item in selected(request, "test_lesson_runs_and_ends_with_ok",
                                       "test_lesson_runs_under_its_documented_torchrun_command")
             if item.callspec.params["lesson"].stem not in CANNOT_RUN_HERE]
    ahead = RunsAhead({item.nodeid: functools.partial(prepared, item) for item in items})
    yield ahead
    ahead.close()


@pytest.mark.lesson
@pytest.mark.parametrize("lesson", [pytest.param(p, id=p.stem, marks=runnable_here(p.stem))
                                    for p in LESSONS])
def test_lesson_runs_and_ends_with_ok(lesson, runs_ahead, request):
    done = runs_ahead.result(request.node.nodeid)
    assert done.args == [sys.executable, str(lesson)]
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"{lesson.name} failed:\n{output}"
    assert last_line(done).startswith("OK"), f"{lesson.name} did not end with OK:\n{output}"


@pytest.mark.lesson
@pytest.mark.slow
@pytest.mark.parametrize("lesson", [pytest.param(p, id=p.stem, marks=runnable_here(p.stem))
                                    for p in TORCHRUN_LESSONS])
def test_lesson_runs_under_its_documented_torchrun_command(lesson, runs_ahead, request):
    command = torchrun_command(lesson)
    done = runs_ahead.result(request.node.nodeid)
    assert done.args == [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}" \
                                 f"{done.stderr[-3000:]}"
    assert last_line(done).startswith("OK"), f"{' '.join(command)}:\n{done.stdout}"
    assert done.stdout.count("OK:") == 1, "only rank 0 should print the OK line"


def test_lessons_that_branch_under_torchrun_are_found():
    """The selection above, checked: it must not quietly drop every torchrun run."""
    stems = {p.stem for p in TORCHRUN_LESSONS}
    assert {"01_processes_and_collectives", "08_miniddp_vs_torch_ddp"} <= stems, stems
    assert "03_data_parallel_by_hand" not in stems, stems
    # their plain runs are their torchrun runs: torchrun --standalone (09), agents (12)
    itself = {p.stem for p in DOCUMENTED_TORCHRUN if runs_torchrun_itself(p)}
    assert {"09_checkpoints_and_restarts", "12_many_machines"} <= itself, itself
    assert "--standalone" in LESSONS_DIR.joinpath("09_checkpoints_and_restarts.py").read_text()


@pytest.mark.parametrize("lesson", [pytest.param(p, id=p.stem) for p in DOCUMENTED_TORCHRUN])
def test_a_documented_torchrun_command_runs_the_lessons_own_file(lesson):
    [script] = [arg for arg in torchrun_command(lesson) if arg.endswith(".py")]
    assert script == f"lessons/{lesson.name}", f"{lesson.name}'s docstring says to run {script}"
    assert (LESSONS_DIR.parent / script).is_file()


@pytest.mark.lesson
@pytest.mark.parametrize("stem", sorted(CANNOT_RUN_HERE))
def test_a_lesson_this_torch_cannot_run_says_why_and_is_skipped(stem, tmp_path):
    [lesson] = LESSONS_DIR.glob(f"{stem}.py")
    done = run([sys.executable, str(lesson)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert last_line(done).startswith("SKIPPED: ") and "torch" in last_line(done), done.stdout


def test_the_lessons_folder_shows_the_lessons():
    """lessons/ holds the numbered lessons, the exercises, the syllabus and the two commands a
    learner types, each only starting its machinery in course/; nothing else (Python's own
    caches aside)."""
    commands = {"grade.py", "run_course.py"}
    others = sorted(p.name for p in LESSONS_DIR.iterdir()
                    if p.name not in {"README.md", "exercises", "__pycache__", *commands}
                    and not re.fullmatch(r"\d\d_\w+\.py", p.name))
    assert others == [], f"lessons/ holds more than the lessons: {others}"
    for name in commands:
        lines = (LESSONS_DIR / name).read_text().splitlines()
        assert len(lines) <= 15 and any("from course." in line for line in lines), name


def test_no_lesson_is_longer_than_350_lines():
    long = {p.name: n for p in LESSONS if (n := len(p.read_text().splitlines())) > 350}
    assert long == {}, f"lessons over 350 lines: {long}"


def write_lessons(directory: Path, lessons: dict[str, str]) -> Path:
    directory.mkdir()
    for name, body in lessons.items():
        (directory / name).write_text(body)
    return directory


def run_course(lessons: Path, tmp_path: Path, *options: str, env: dict | None = None):
    command = [sys.executable, str(LESSONS_DIR / "run_course.py"), "--lessons-dir", str(lessons),
               *options]
    done = run(command, tmp_path, cwd=tmp_path, timeout=60) if env is None else \
        subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    return done


def test_run_course_reports_a_failing_lesson_and_exits_non_zero(tmp_path):
    lessons = write_lessons(tmp_path / "lessons", {
        "00_fine.py": "print('step 1'); print('OK: fine')\n",
        "01_broken.py": "raise AssertionError('the loss went up')\n",
        "02_silent.py": "print('finished, but proved nothing')\n",
        "03_hangs.py": "import time\nprint('OK: too early', flush=True)\ntime.sleep(60)\n",
        "helper.py": "raise SystemExit('not a lesson: must not run')\n",
    })
    done = run_course(lessons, tmp_path, "--timeout", "4")
    assert done.returncode == 1, done.stdout + done.stderr
    table = done.stdout.split("\nlesson")[-1]
    assert re.search(r"00_fine\.py\s+OK\s", table)
    assert re.search(r"01_broken\.py\s+FAILED \(exit 1\)", table)
    assert re.search(r"02_silent\.py\s+FAILED \(no OK line\)", table)
    assert re.search(r"03_hangs\.py\s+TIMEOUT", table)
    assert "helper.py" not in done.stdout
    assert "01_broken.py: AssertionError: the loss went up" in table  # why, under the table
    assert "1 of 4 lessons passed" in done.stdout


def test_run_course_shows_each_lessons_narrative_as_it_runs(tmp_path):
    lessons = write_lessons(tmp_path / "lessons", {
        "00_story.py": "print('the loss falls: 0.5'); print('the loss falls: 0.1')\n"
                       "print('OK: a story')\n",
        "01_more.py": "print('a second lesson speaks'); print('OK: more')\n"})
    done = run_course(lessons, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    story = [out.index(line) for line in ("=== 00_story.py", "    the loss falls: 0.5",
                                          "    the loss falls: 0.1", "    OK: a story",
                                          "=== 01_more.py", "    a second lesson speaks",
                                          "\nlesson")]
    assert story == sorted(story), out
    quiet = run_course(lessons, tmp_path, "--quiet")
    assert quiet.returncode == 0 and "the loss falls" not in quiet.stdout, quiet.stdout
    assert "2 of 2 lessons passed" in quiet.stdout



def test_run_course_shows_each_lessons_measured_seconds_beside_its_claim(tmp_path):
    lessons = write_lessons(tmp_path / "lessons", {
        "00_claims.py": '"""A lesson. About 7 s on two CPU cores."""\nprint("OK: claimed")\n',
        "01_silent.py": '"""A lesson that claims no time."""\nprint("OK: silent")\n'})
    done = run_course(lessons, tmp_path, "--quiet")
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.split("\nlesson")[-1]
    assert re.match(r"\s+result\s+seconds\s+claimed\n", table), table
    assert re.search(r"00_claims\.py\s+OK\s+\d+\.\d\s+about 7\n", table), table
    assert re.search(r"01_silent\.py\s+OK\s+\d+\.\d\s+-\n", table), table

TORCHRUN_FAILURE = """
import sys
print("[agent 0] step 0/40 | loss 0.52211")
print("[agent 1] rank 1 of 2 raised:", file=sys.stderr)
print("[agent 1] Traceback (most recent call last):", file=sys.stderr)
print('[agent 1]   File "lesson.py", line 3, in on_every_rank', file=sys.stderr)
print("[agent 1] course.report.CheckFailed: the workers ended with different parameters",
      file=sys.stderr)
print("[agent 1] [rank1]: course.report.CheckFailed: the workers ended with "
      "different parameters",
      file=sys.stderr)
print("[agent 0] rank 0 of 2 raised:", file=sys.stderr)
print("[agent 0] RuntimeError: Connection closed by peer", file=sys.stderr)
for _ in range(30):
    print("[agent 1] torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
    print("[agent 1]   rank      : 1 (local_rank: 0)")
sys.exit("FAILED: torchrun exited with status [1, 1]")
"""


def test_run_course_names_the_failed_check_and_its_rank_under_torchruns_report(tmp_path):
    lessons = write_lessons(tmp_path / "lessons", {"12_many.py": TORCHRUN_FAILURE})
    done = run_course(lessons, tmp_path, "--quiet")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "12_many.py: rank 1 of 2: CheckFailed: the workers ended with different parameters" \
        in done.stdout, done.stdout
    assert "ChildFailedError" not in done.stdout  # --quiet: the table and the reason only


@pytest.mark.lesson
def test_run_course_names_the_failed_check_and_rank_of_a_broken_lesson(tmp_path):
    """A real lesson whose ranks miniddp forks, broken from outside (tests/support/breakage)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(LESSONS_DIR.parent),
                                           str(LESSONS_DIR.parent / "tests" / "support" /
                                           "breakage")]),
               MINIDDP_BREAK="set_epoch_ignored", MINIDDP_RUNS=str(tmp_path / "runs"))
    done = run_course(LESSONS_DIR, tmp_path, "04", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "    2. shuffle=True" in done.stdout  # the lesson's own story, streamed
    assert re.search(r"04_the_sampler\.py: rank \d of 2: CheckFailed: with set_epoch, three "
                     r"epochs must give three different orders", done.stdout), done.stdout


def test_run_course_passes_when_every_lesson_passes(tmp_path):
    lessons = write_lessons(tmp_path / "lessons", {"00_a.py": "print('OK: a')\n",
                                                   "01_b.py": "print('OK: b')\n"})
    done = run_course(lessons, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 lessons passed" in done.stdout


def test_run_course_lists_a_lesson_that_cannot_run_here_as_skipped_not_failed(tmp_path):
    """Lesson 16 on torch < 2.3 says why it cannot run and exits 0: skipped, with its reason.
    A lesson that says SKIPPED and then fails is still a failure."""
    lessons = write_lessons(tmp_path / "lessons", {
        "00_a.py": "print('OK: a')\n",
        "01_newer.py": "print('SKIPPED: this lesson needs torch >= 9.0; this is torch 2.1')\n",
        "02_lies.py": "print('SKIPPED: not really'); raise SystemExit(3)\n"})
    done = run_course(lessons, tmp_path, "--quiet")
    assert done.returncode == 1, done.stdout + done.stderr
    table = done.stdout.split("\nlesson")[-1]
    assert re.search(r"01_newer\.py\s+SKIPPED\s", table)
    assert re.search(r"02_lies\.py\s+FAILED \(exit 3\)", table)
    assert "1 of 3 lessons passed, 1 skipped (01_newer.py); failed: 02_lies.py" in table
    assert "01_newer.py (skipped): this lesson needs torch >= 9.0; this is torch 2.1" in table
    alone = run_course(lessons, tmp_path, "00", "01")
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "1 of 2 lessons passed, 1 skipped (01_newer.py)" in alone.stdout
