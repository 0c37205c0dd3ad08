"""lessons/grade.py: shipped exercises fail saying what to write, solutions pass, and a wrong
solution fails the check that names its mistake."""

import ast
import os
import re
import sys
from pathlib import Path

import pytest
from lesson_modules import CANNOT_RUN_HERE, LESSONS_DIR
from warm_python import warm_python

GRADE = LESSONS_DIR / "grade.py"
SOLUTIONS = LESSONS_DIR / "exercises" / "solutions"
NUMBERS = ["03", "04", "05", "06", "07", "15"] + ([] if "17_fsdp" in CANNOT_RUN_HERE
                                                  else ["17", "17b", "18"])


GRADER_WARM = ("grade", "torch._dynamo")  # the grader's own imports, with its settings


def grader_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def grade(*args, timeout=240, env=None, slot=0):
    """``python lessons/grade.py *args``, from a warm interpreter that has run the grader's
    imports (``tests/support/warm_python.py``: a fresh forked process per call, without the seconds
    of
    ``import torch``); ``slot`` 1 is a second such interpreter, for a second run at once."""
    warm = warm_python(GRADER_WARM, path=str(LESSONS_DIR), slot=slot)
    return warm.run([sys.executable, str(GRADE), *map(str, args)], env=env or grader_env(),
                    cwd=LESSONS_DIR.parent, timeout=timeout)


def unwrapped(stdout: str) -> str:
    """The grader's output with each wrapped verdict on one line again (a continued line is
    indented by 10 spaces, a verdict's first line by 2 or 8)."""
    return re.sub(r"\n {10}(?=\S)", " ", stdout)


def sections(stdout: str) -> dict[str, str]:
    """The grader's output, exercise by exercise, each verdict on one line."""
    parts = re.split(r"^exercise (\d\d[a-z]?): .*$", unwrapped(stdout), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def first_failure(section: str, name: str, check: str, words) -> tuple[list[str], list[int]]:
    """One exercise's verdict: its lines and the indices of its FAIL lines, after checking that
    the first FAIL is ``check`` and the reason under it holds every one of ``words``."""
    lines = section.splitlines()
    failed = [k for k, line in enumerate(lines) if line.strip().startswith("FAIL")]
    assert failed, f"{name} passed:\n{section}"
    assert check in lines[failed[0]], f"{name}:\n{section}"
    why = lines[failed[0] + 1] if failed[0] + 1 < len(lines) else ""
    assert all(w in why for w in words), f"{name}: {why!r} lacks {words}"
    return lines, failed


def solution_lines(number: str) -> list[str]:
    """The reference solution's lines of code that the exercise leaves out."""
    exercise = next((LESSONS_DIR / "exercises").glob(f"{number}_*.py")).read_text()
    solution = next(SOLUTIONS.glob(f"{number}_*.py")).read_text()
    return [line.strip() for line in solution.splitlines()
            if len(line.strip()) > 12 and line not in exercise and line.strip()[0] not in "\"#"]


def docstrings(path) -> dict[str, str | None]:
    """A file's docstrings: the module's (key ``""``) and each class's and function's, by its
    dotted name (``Reducer._on_ready``)."""
    found = {}

    def visit(node, prefix):
        found[prefix.rstrip(".") if prefix else ""] = ast.get_docstring(node, clean=False)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return found


@pytest.mark.parametrize("number", NUMBERS)
def test_each_solution_says_what_its_exercise_says(number):
    """The learner reads the exercise; its solution must carry the same text, word for word
    (the module's docstring and those of every class and function the exercise has)."""
    exercise = docstrings(next((LESSONS_DIR / "exercises").glob(f"{number}_*.py")))
    solution = docstrings(next(SOLUTIONS.glob(f"{number}_*.py")))
    differ = [name or "the module" for name, text in exercise.items()
              if solution.get(name, "(missing)") != text]
    assert differ == [], f"exercise {number}'s solution says otherwise in: {differ}"


@pytest.mark.slow
def test_shipped_exercises_all_fail_saying_what_to_write():
    done = grade()
    assert done.returncode == 1, done.stdout + done.stderr
    found = sections(done.stdout)
    assert sorted(found) == NUMBERS
    for number, text in found.items():
        assert f"TODO  not written yet: exercise {number}" in text, text
        assert f"python lessons/grade.py --hint {number}" in text, text
        assert "PASS" not in text
        for line in solution_lines(number):  # says what must be true, not the code
            assert line not in text, f"exercise {number}'s instruction dictates {line!r}"
    assert f"0 of {len(NUMBERS)} exercises pass; next: python lessons/grade.py 03" in done.stdout
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("  ")]
    assert max(map(len, verdicts)) <= 100, "the TODO instructions are not wrapped"
    assert any(line.startswith(" " * 10) for line in verdicts)  # as unwrapped() expects


@pytest.mark.slow
def test_reference_solutions_all_pass():
    done = grade("--solutions")
    assert done.returncode == 0, done.stdout + done.stderr
    found = sections(done.stdout)
    assert sorted(found) == NUMBERS
    assert all("PASS" in text and "FAIL" not in text and "TODO" not in text
               for text in found.values()), done.stdout
    assert f"{len(NUMBERS)} of {len(NUMBERS)} exercises pass" in done.stdout


def test_one_exercise_by_number():
    done = grade("04", "--solutions")
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(sections(done.stdout)) == ["04"]


def test_an_unknown_exercise_is_refused():
    done = grade("99")
    assert done.returncode == 2 and "no exercise 99" in done.stderr


# Each: (exercise, text in the solution, the mistake put in its place, the check that must fail)
MISTAKES = {
    "03": ("p.grad.mul_(1.0 / world_size)\n", "pass\n",
           "2 ranks: every .grad equals torch's DDP's bit for bit"),
    "04": ("order = (order * -(-total_size // dataset_len))[:total_size]",
           "order = order[:total_size]",
           "every rank's indices equal torch's DistributedSampler's"),
    "05": ("return list(reversed(sorted(closed, key=min)))", "return sorted(closed, key=min)",
           "the layout of torch's _compute_bucket_assignment_by_size, reversed"),
    "06": ("self.in_flight.append(dist.all_reduce(self.flat[k], async_op=True))",
           "self.in_flight.append(dist.all_reduce(self.flat[k], async_op=True))\n"
           "            self.in_flight[-1].wait()",
           "no all_reduce is waited for before backward has computed every gradient"),
    "07": ("            with ddp.no_sync():\n                (F.mse_loss(ddp(x), y) / k)"
           ".backward()", "            (F.mse_loss(ddp(x), y) / k).backward()",
           "one all_reduce round per step"),
}


@pytest.mark.slow
def test_each_wrong_solution_fails_the_check_that_names_its_mistake(graded):
    for number, (_, _, check) in MISTAKES.items():
        text = graded("mistakes", number)
        failed = [line for line in text.splitlines() if line.strip().startswith("FAIL")]
        assert any(check in line for line in failed), f"{number}:\n{text}"


# Each: (exercise, text in the solution, the mistake, the check that must fail, words its message
# must hold). One grader run per case, so that several mistakes in one exercise can be shown.
ROOT_CAUSES = {
    "03 divides after the sum": (
        "03", "        p.grad.mul_(1.0 / world_size)\n        dist.all_reduce(p.grad)\n",
        "        dist.all_reduce(p.grad)\n        p.grad.div_(world_size)\n",
        "3 ranks: bit for bit the gradients of torch's arithmetic",
        "multiply by the reciprocal BEFORE the all_reduce"),
    "06 never queues _finish": (
        "06", "            if k == len(self.buckets) - 1:\n                torch.autograd.Variable"
        "._execution_engine.queue_callback(self._finish)\n", "",
        "_finish runs at the end of every backward",
        "_finish never ran: no bucket was waited for or copied back. Queue it on the autograd "
        "engine with torch.autograd.Variable._execution_engine.queue_callback"),
    "06 never resets its state": (
        "06", "        self.missing = [len(members) for members in self.buckets]\n"
        "        self.in_flight = []\n\n", "\n",
        "every backward starts from a reset state", "reset the state at the end of _finish"),
    "06 divides instead of multiplying by the reciprocal": (
        "06", "torch.mul(param.grad, 1.0 / self.world_size, out=view)",
        "torch.div(param.grad, self.world_size, out=view)",
        "3 ranks: .grad equals torch's DDP's bit for bit",
        "2 ranks matched, so this points at the scaling arithmetic"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(ROOT_CAUSES))
def test_a_wrong_solution_fails_naming_its_root_cause(graded, case):
    _, _, _, check, words = ROOT_CAUSES[case]
    text = graded("root causes", case)
    lines = text.splitlines()
    failed = [k for k, line in enumerate(lines) if line.strip().startswith("FAIL")]
    assert failed and check in lines[failed[0]], text
    assert words in lines[failed[0] + 1], text


@pytest.mark.parametrize("number", NUMBERS)
def test_hints_come_in_steps_and_only_the_last_prints_the_code(number):
    """The idea first, then the shape, then the lines the instruction leaves out: a learner
    asking for a hint is not handed the whole solution at once."""
    steps = [grade("--hint", number, "--step", str(step)) for step in (1, 2, 3)]
    assert all(done.returncode == 0 for done in steps), [d.stdout + d.stderr for d in steps]
    assert grade("--hint", number).stdout == steps[0].stdout
    lines = solution_lines(number)
    for step, done in enumerate(steps[:2], 1):
        given = [line for line in lines if line in done.stdout]
        assert given == [], f"hint {step} of {number} prints the code {given}"
        assert f"--hint {number} --step {step + 1}" in done.stdout, done.stdout
    assert all(line in steps[2].stdout for line in lines), steps[2].stdout
    assert len({done.stdout for done in steps}) == 3


def test_an_unknown_hint_is_refused():
    assert grade("--hint", "99").returncode == 2


def test_help_is_plain_text():
    done = grade("--help")
    assert done.returncode == 0 and "--hint" in done.stdout and "``" not in done.stdout


def test_a_directory_without_the_file_is_refused_with_a_message(tmp_path):
    for args in (["--dir", tmp_path], ["05", "--dir", tmp_path]):
        done = grade(*args)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "05_*.py" in done.stderr and "no file" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_a_crash_shows_the_learners_line_and_next_keeps_the_flags(tmp_path):
    solution = next(SOLUTIONS.glob("07_*.py"))
    text = solution.read_text()
    assert "    optimizer.step()\n" in text
    (tmp_path / solution.name).write_text(text.replace("optimizer.step()", "optimizer.stepp()"))
    done = grade("--dir", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not graded" in done.stdout
    assert "raised: AttributeError" in done.stdout
    assert "at 07_no_sync.py:" in done.stdout and "optimizer.stepp()" in done.stdout
    assert f"next: python lessons/grade.py 07 --dir {tmp_path}" in done.stdout



# ----- the grader's own failures are reported as the grader's, never as the learner's -----

def the_graders_own_fault():
    """Stands for a bug on the grader's side of a rank's task: none of the learner's code runs."""
    return [][0]


def torch_raising_on_what_the_grader_was_handed():
    """The grader's code calling torch, which raises: what it was handed may be the learner's
    doing (a gradient of the wrong shape), so it is not called the grader's fault."""
    import torch
    return torch.zeros(2) + torch.zeros(3)


def the_learners_fault():
    """The learner's function, called from the grader's task: its error is the learner's."""
    return sys.modules["exercise_04"].raise_mine()


def graded_in_process(number: str, grader, path: Path, capfd, learner: str | None = None):
    """``cli.grade`` of ``path`` with ``grader`` as exercise ``number``'s checks, in this
    process; (passed, what it printed)."""
    from course.grader import checks, cli
    original = cli.GRADERS[number]
    cli.GRADERS[number] = grader
    try:
        if learner:
            cli.load(path, f"exercise_{number}_learner")
            sys.modules[f"exercise_{number}"] = sys.modules[f"exercise_{number}_learner"]
            checks.ALIASES[f"exercise_{number}"] = f"exercise_{number}_learner"
        return cli.grade(number, path, None), capfd.readouterr().out
    finally:
        cli.GRADERS[number] = original
        checks.ALIASES.pop(f"exercise_{number}", None)
        checks.close_groups()


def test_an_exception_in_the_graders_code_on_a_rank_is_a_grader_error(capfd):
    from course.grader import checks

    def grader():
        yield True, "a check before it", ""
        checks.on_ranks(2, the_graders_own_fault)
    passed, out = graded_in_process("04", grader, next(SOLUTIONS.glob("04_*.py")), capfd)
    assert not passed
    assert "ERROR the grader itself failed (on rank 0 of 2)" in out, out
    assert "no verdict on your solution" in unwrapped(out), out
    assert "in the_graders_own_fault" in out and "IndexError" in out, out
    assert "FAIL" not in out and "raised:" not in out, out


def test_an_exception_in_the_graders_verdicts_is_a_grader_error(capfd):
    def grader():
        yield True, "a check before it", ""
        next(iter([]))
    passed, out = graded_in_process("04", grader, next(SOLUTIONS.glob("04_*.py")), capfd)
    assert not passed
    assert "ERROR the grader itself failed (while judging)" in out, out
    assert "StopIteration" in out and "in grader" in out, out
    assert "FAIL" not in out, out


def test_an_exception_raised_inside_torch_is_not_called_the_graders(capfd):
    from course.grader import checks

    def grader():
        checks.on_ranks(2, torch_raising_on_what_the_grader_was_handed)
        yield True, "never reached", ""
    passed, out = graded_in_process("04", grader, next(SOLUTIONS.glob("04_*.py")), capfd)
    assert not passed
    assert "FAIL  rank 0 of 2 raised: RuntimeError" in out, out
    assert "ERROR" not in out, out


def test_an_exception_in_the_learners_code_stays_the_learners(tmp_path, capfd):
    from course.grader import checks
    path = tmp_path / "04_mine.py"
    path.write_text("def raise_mine():\n    raise ValueError('my own mistake')\n")

    def grader():
        checks.on_ranks(2, the_learners_fault)
        yield True, "never reached", ""
    passed, out = graded_in_process("04", grader, path, capfd, learner="04")
    assert not passed
    assert "FAIL  rank 0 of 2 raised: ValueError: my own mistake" in out, out
    assert "at 04_mine.py:2 in raise_mine" in out, out
    assert "ERROR" not in out, out



@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_two_values_that_differ_are_shown_so_that_they_differ(dtype):
    """Neighbouring values of each dtype, as a verdict writes them: "yours 0.0112974, torch's
    0.0112974" would say they are equal."""
    import torch

    from course.grader.checks import shown
    mine = torch.tensor(0.0112974, dtype=getattr(torch, dtype))
    torchs = torch.nextafter(mine, torch.tensor(1.0, dtype=mine.dtype))
    said = shown(mine.item(), torchs.item())
    yours, theirs = said.removeprefix("yours ").split(", torch's ")
    assert yours != theirs, said
    assert float(yours) == mine.item() and float(theirs) == torchs.item(), said


# ----- wrong solutions of each class the grader must catch, several of each -----
# Each: (exercise, [(text in the solution, what replaces it), ...], the check whose FAIL line
# must be the first, words the line after it must hold, words it must not hold).
SCALE_03 = "        p.grad.mul_(1.0 / world_size)\n        dist.all_reduce(p.grad)\n"
LOOP_03 = ("    for p in model.parameters():\n        if p.grad is None:\n            continue\n"
           "        p.grad.mul_(1.0 / world_size)\n        dist.all_reduce(p.grad)\n")


def loop_03(body: str, after: str = "") -> list[tuple[str, str]]:
    return [(LOOP_03, "    works = []\n    for p in model.parameters():\n        if p.grad is None:"
                      "\n            continue\n" + body + after)]


LAUNCH_06 = ("        while len(self.in_flight) < len(self.buckets) and self.missing[len(self.in_"
             "flight)] == 0:\n            k = len(self.in_flight)\n            self._record("
             "\"launch\", k)\n            self.in_flight.append(dist.all_reduce(self.flat[k], "
             "async_op=True))\n            if k == len(self.buckets) - 1:\n")
WHEN_COMPLETE_06 = ("        if self.missing[b] == 0:  # launched at once, whatever came before\n"
                    "            k = b\n            self._record(\"launch\", k)\n"
                    "            self.in_flight.append(KEEP)\n"
                    "            if len(self.in_flight) == len(self.buckets):\n")
QUEUE_06 = "torch.autograd.Variable._execution_engine.queue_callback(self._finish)"
WAIT_06 = "            work.wait()\n"
WHICH_03 = "3 ranks: bit for bit the gradients of torch's arithmetic"
BITS_03 = "2 ranks: every .grad equals torch's DDP's bit for bit"
CLOSE_05 = "        if entry[1] >= (first_bytes if entry[2] == 0 else cap_bytes):\n"
AT_LIMITS = "parameter lists at the limits"

WRONG = {
    # 03: a result still in flight when the learner's function returns
    "03 async, never waited": ("03", [("        dist.all_reduce(p.grad)\n",
                                        "        dist.all_reduce(p.grad, async_op=True)\n")],
                               "2 ranks: .grad holds its final value when average_gradients "
                               "returns", ["still in flight"], []),
    "03 async, all waited but the last": (
        "03", loop_03("        p.grad.mul_(1.0 / world_size)\n"
                      "        works.append(dist.all_reduce(p.grad, async_op=True))\n",
                      "    for work in works[:-1]:\n        work.wait()\n"),
        "2 ranks: .grad holds its final value", ["still in flight"], []),
    "03 async, works kept and dropped": (
        "03", loop_03("        p.grad.mul_(1.0 / world_size)\n"
                      "        works.append(dist.all_reduce(p.grad, async_op=True))\n",
                      "    works.clear()\n"),
        "2 ranks: .grad holds its final value", ["still in flight"], []),
    "03 async, only the first waited": (
        "03", loop_03("        p.grad.mul_(1.0 / world_size)\n"
                      "        works.append(dist.all_reduce(p.grad, async_op=True))\n",
                      "    works[0].wait()\n"),
        "2 ranks: .grad holds its final value", ["still in flight", "never waited for"], []),
    # 03: large differences named as what they are, never as rounding
    "03 sum, not the mean": ("03", [("        p.grad.mul_(1.0 / world_size)\n", "")],
                             BITS_03, ["not rounding", "the SUM over the ranks"],
                             ["rounds", "rounding-sized"]),
    "03 all_reduce of a copy": ("03", [("dist.all_reduce(p.grad)",
                                        "dist.all_reduce(p.grad.clone())")],
                                BITS_03, ["not rounding", "own gradient scaled, never summed"],
                                ["rounds", "rounding-sized"]),
    "03 all_reduce of a new tensor": (
        "03", [(SCALE_03, "        g = p.grad * (1.0 / world_size)\n        dist.all_reduce(g)\n")],
        BITS_03, ["did not write into p.grad"], ["rounds", "rounding-sized"]),
    "03 scaled twice": ("03", [("        dist.all_reduce(p.grad)\n",
                                "        dist.all_reduce(p.grad)\n"
                                "        p.grad.mul_(1.0 / world_size)\n")],
                        BITS_03, ["not rounding", "scaled twice"], ["rounds", "rounding-sized"]),
    # 05: a bucket closed when it exceeds its limit instead of when it reaches it
    "05 closes when over the limit": ("05", [(CLOSE_05, CLOSE_05.replace(">=", ">"))],
                                      AT_LIMITS, ["at least its limit", "exactly at"], []),
    "05 first limit exceeded": ("05", [(CLOSE_05, "        if (entry[1] > first_bytes) if entry"
                                        "[2] == 0 else (entry[1] >= cap_bytes):\n")],
                                AT_LIMITS, ["exactly at the first limit"], []),
    "05 cap exceeded": ("05", [(CLOSE_05, "        if (entry[1] >= first_bytes) if entry[2] == 0"
                                " else (entry[1] > cap_bytes):\n")],
                        AT_LIMITS, ["the cap"], []),
    "05 closes before adding one that would not fit": (
        "05", [("        entry[0].append(i)\n        entry[1] += p.numel() * p.element_size()\n"
                + CLOSE_05,
                "        size = p.numel() * p.element_size()\n"
                "        if entry[0] and entry[1] + size > (first_bytes if entry[2] == 0 else "
                "cap_bytes):\n            closed.append(entry[0])\n"
                "            entry[0], entry[1], entry[2] = [], 0, entry[2] + 1\n"
                "        entry[0].append(i)\n        entry[1] += size\n        if False:\n")],
        AT_LIMITS, ["at least its limit"], []),
    # 06: buckets launched as they complete, ignoring the ones before them
    "06 launched when complete, waited in bucket order": (
        "06", [(LAUNCH_06, WHEN_COMPLETE_06.replace(
            "KEEP", "(k, dist.all_reduce(self.flat[k], async_op=True))")),
               ("for b, work in enumerate(self.in_flight):",
                "for b, work in sorted(self.in_flight, key=lambda kept: kept[0]):")],
        "buckets are launched in bucket order", ["buckets set to", "the all_reduces went to "
                                                 "buckets [1, 0", "waits for the ones before "
                                                 "it"], []),
    "06 launched when complete, kept in launch order": (
        "06", [(LAUNCH_06, WHEN_COMPLETE_06.replace(
            "KEEP", "dist.all_reduce(self.flat[k], async_op=True)"))],
        "buckets are launched in bucket order", ["waits for the ones before it"], []),
    # 06: _finish run from the last hook instead of by the autograd engine
    "06 _finish called from the hook": ("06", [(QUEUE_06, "self._finish()")],
                                        "_finish is run by the autograd engine",
                                        ["called from inside the hook", "queue_callback"], []),
    "06 _finish called by a helper of the hook": (
        "06", [(QUEUE_06, "self._done()"),
               ("    def _finish(self) -> None:\n",
                "    def _done(self) -> None:\n        self._finish()\n\n"
                "    def _finish(self) -> None:\n")],
        "_finish is run by the autograd engine", ["called from inside the hook"], []),
    # 06: launched works never waited for
    "06 no wait": ("06", [(WAIT_06, "")], "every launched all_reduce is waited for",
                   ["never waited for"], []),
    "06 only the last waited": ("06", [(WAIT_06, "            if b == len(self.in_flight) - 1:\n"
                                                 "                work.wait()\n")],
                                "every launched all_reduce is waited for",
                                ["never waited for"], []),
    "06 all but the first waited": ("06", [(WAIT_06, "            if b > 0:\n"
                                                     "                work.wait()\n")],
                                    "every launched all_reduce is waited for",
                                    ["never waited for"], []),
    # 07: the wrong micro-batch synchronizes
    "07 the first micro-batch synchronizes": ("07", [("        if j < k - 1:\n",
                                                      "        if j > 0:\n")],
                                              "the micro-batch that synchronizes is the last",
                                              ["[[1, 0, 0],", "expected [0, 0, 1]",
                                               "Micro-batch 0 synchronized and the last did "
                                               "not"], []),
    "07 a middle micro-batch synchronizes": ("07", [("        if j < k - 1:\n",
                                                     "        if j != 1:\n")],
                                             "the micro-batch that synchronizes is the last",
                                             ["[[0, 1, 0],"], []),
}


# Later FAIL lines whose message must hold the same words (and not the absent ones) as the first
ALSO = {"03 sum, not the mean": WHICH_03, "03 all_reduce of a copy": WHICH_03,
        "03 all_reduce of a new tensor": "3 ranks: every rank holds the same bits",
        "03 scaled twice": WHICH_03}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_solution_of_each_class_fails_first_the_check_that_names_it(graded, name):
    number, _, check, words, absent = WRONG[name]
    lines, failed = first_failure(graded("wrong", name), name, check, words)
    why = lines[failed[0] + 1] if failed[0] + 1 < len(lines) else ""
    assert not any(w in why for w in absent), f"{name}: {why!r} holds one of {absent}"
    if name in ALSO:
        [k] = [k for k in failed if ALSO[name] in lines[k]]
        assert all(w in lines[k + 1] for w in words), f"{name}: {lines[k + 1]!r}"
        assert not any(w in lines[k + 1] for w in absent), f"{name}: {lines[k + 1]!r}"


# Other right solutions: they must pass every check, or the grader dictates one way of writing
RIGHT = {
    "03": loop_03("        p.grad.mul_(1.0 / world_size)\n"
                  "        works.append(dist.all_reduce(p.grad, async_op=True))\n",
                  "    for work in works:\n        work.get_future().wait()\n"),
    "06": [(WAIT_06, "            work.get_future().wait()\n")],
}


@pytest.mark.slow
@pytest.mark.parametrize("number", list(RIGHT))
def test_other_right_solutions_pass(graded, number):
    text = graded("right", number)
    assert "PASS" in text and "FAIL" not in text, text


# ----- wrong solutions the grader once misnamed or let pass: each now named for what it is -----
# Each: (exercise, edits, the check whose FAIL line must be the first, words the line after it
# must hold, words no FAIL line's message may hold).
NAMED = {
    "03 divides before the sum": (
        "03", [("p.grad.mul_(1.0 / world_size)", "p.grad.div_(world_size)")], WHICH_03,
        ["You divided each gradient by world_size before the all_reduce", "lesson 08"],
        ["Dividing after the sum", "lesson 03"]),
    "03 divides after the sum": (
        "03", [(SCALE_03, "        dist.all_reduce(p.grad)\n        p.grad.div_(world_size)\n")],
        WHICH_03, ["You divided the sum by world_size", "BEFORE the all_reduce", "lesson 08"],
        ["lesson 03"]),
    "03 multiplies the sum by the reciprocal": (
        "03", [(SCALE_03, "        dist.all_reduce(p.grad)\n"
                          "        p.grad.mul_(1.0 / world_size)\n")],
        WHICH_03, ["You multiplied the sum by 1 / world_size", "BEFORE the all_reduce"],
        ["Dividing after the sum", "lesson 03"]),
    "03 only rank 0 all_reduces": (
        "03", [("        dist.all_reduce(p.grad)\n",
                "        if dist.get_rank() == 0:\n            dist.all_reduce(p.grad)\n")],
        "every rank makes the same collective calls, in the same order",
        ["rank 0 called all_reduce", "rank 1 never called this all_reduce"],
        ["Timed out", "recv"]),
    "04 contiguous blocks": (
        "04", [("return order[rank:total_size:num_replicas]",
                "return order[rank * num_samples:(rank + 1) * num_samples]")],
        "every rank's indices equal torch's", ["contiguous, not strided"], []),
    "05 not reversed": (
        "05", [("return list(reversed(sorted(closed, key=min)))",
                "return sorted(closed, key=min)")],
        "the layout of torch's _compute_bucket_assignment_by_size", ["opposite order"], []),
    "06 scales after the all_reduce": (
        "06", [("torch.mul(param.grad, 1.0 / self.world_size, out=view)",
                "view.copy_(param.grad)"),
               ("self.params[i].grad.copy_(self.views[i][1])",
                "self.params[i].grad.copy_(self.views[i][1] * (1.0 / self.world_size))")],
        "3 ranks: .grad equals torch's DDP's bit for bit", ["in the hook, before the all_reduce"],
        ["lesson 03"]),
    "06 copies before the wait": (
        "06", [(WAIT_06 + "            for i in self.buckets[b]:\n"
                "                self.params[i].grad.copy_(self.views[i][1])\n",
                "            for i in self.buckets[b]:\n"
                "                self.params[i].grad.copy_(self.views[i][1])\n" + WAIT_06)],
        "every bucket is read after its all_reduce finished",
        ["you read the bucket before its all_reduce finished"], []),
    "06 _finish queued at every launch": (
        "06", [("            if k == len(self.buckets) - 1:\n                " + QUEUE_06,
                "            if True:\n                " + QUEUE_06)],
        "_finish runs exactly once per backward", ["_finish ran", "queue it once per backward"],
        []),
    "06 launched when complete: later checks blame the order": (
        "06", [(LAUNCH_06, WHEN_COMPLETE_06.replace(
            "KEEP", "dist.all_reduce(self.flat[k], async_op=True)"))],
        "buckets are launched in bucket order", ["waits for the ones before it"],
        ["-1: not a bucket's buffer", "scaling", "reciprocal"]),
    "06 rank 0 all_reduces a bucket twice": (
        "06", [("            self.in_flight.append(dist.all_reduce(self.flat[k], async_op=True))\n",
                "            self.in_flight.append(dist.all_reduce(self.flat[k], async_op=True))\n"
                "            if dist.get_rank() == 0:\n"
                "                dist.all_reduce(self.flat[k], async_op=True).wait()\n")],
        "every rank makes the same collective calls, in the same order",
        ["rank 0 called all_reduce for the 2nd time", "rank 1 never called this all_reduce"],
        ["Timed out", "recv"]),
    "07 loss not divided by k": (
        "07", [("                (F.mse_loss(ddp(x), y) / k).backward()\n        else:\n"
                "            (F.mse_loss(ddp(x), y) / k).backward()\n",
                "                F.mse_loss(ddp(x), y).backward()\n        else:\n"
                "            F.mse_loss(ddp(x), y).backward()\n")],
        "2 ranks: parameters equal the correct loop's",
        ["k times the right one", "Divide each micro-batch's loss by k"],
        ["zero_grad once"]),
    "04 the shuffle ignores the epoch": (
        "04", [("        g.manual_seed(seed + epoch)", "        g.manual_seed(seed)")],
        "every rank's indices equal torch's", ["epoch 0's order", "ignores the epoch",
                                                "seed + epoch"], ["contiguous"]),
    "04 the shuffle ignores the seed": (
        "04", [("        g.manual_seed(seed + epoch)", "        g.manual_seed(epoch)")],
        "every rank's indices equal torch's", ["the seed", "seed + epoch"], ["contiguous"]),
    "06 launches only the bucket that completed": (
        "06", [("        while len(self.in_flight) < len(self.buckets) and self.missing[len(self."
                "in_flight)] == 0:\n            k = len(self.in_flight)\n",
                "        if self.missing[b] == 0 and b == len(self.in_flight):\n"
                "            k = b\n")],
        "_finish runs at the end of every backward",
        ["buckets set to", "were never launched", "in a loop"], ["Queue it on the autograd"]),
    "06 never counts a gradient in": (
        "06", [("        self.missing[b] -= 1\n", "")], "_finish runs at the end of every backward",
        ["were never launched", "count each gradient"], ["in a loop"]),
    "06 never waits: the bits blame the wait": (
        "06", [(WAIT_06, "")], "every launched all_reduce is waited for", ["never waited for"],
        ["reciprocal", "scaling"]),
    "07 zero_grad before every micro-batch": (
        "07", [("    optimizer.zero_grad()\n    for j, (x, y) in enumerate(micro_batches):\n",
                "    for j, (x, y) in enumerate(micro_batches):\n        optimizer.zero_grad()\n")],
        "2 ranks: parameters equal the correct loop's",
        ["zero_grad() ran before every micro-batch", "once, before the first"], ["zero_grad once"]),
    "07 a step after every micro-batch": (
        "07", [("            (F.mse_loss(ddp(x), y) / k).backward()\n    optimizer.step()\n",
                "            (F.mse_loss(ddp(x), y) / k).backward()\n        optimizer.step()\n")],
        "2 ranks: parameters equal the correct loop's",
        ["step() ran after every micro-batch", "Step once"], ["zero_grad once"]),
    "15 balanced by parameter count": (
        "15", [("load[result[i]] += params[i].numel()", "load[result[i]] += 1")],
        "owners: torch's ZeroRedundancyOptimizer's partition", ["number of parameters"], []),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NAMED))
def test_a_wrong_solution_is_named_for_what_it_is(graded, name):
    number, _, check, words, absent = NAMED[name]
    lines, failed = first_failure(graded("named", name), name, check, words)
    for k in failed:
        later = lines[k + 1] if k + 1 < len(lines) else ""
        assert not any(w in later for w in absent), f"{name}: {later!r} holds one of {absent}"


# gloo's ReduceOp.AVG (torch 2.8 on) sums, then divides: the grader says so, since the learner
# wrote no division
AVG = {"03 ReduceOp.AVG": (
    "03", [(SCALE_03, "        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)\n")], WHICH_03,
    ["You divided the sum by world_size", "ReduceOp.AVG", "default op, SUM"], [])}


@pytest.mark.slow
def test_an_average_by_reduce_op_avg_is_named(graded):
    text = graded("avg", "03 ReduceOp.AVG")
    if re.search(r"raised: .*AVG", text):
        pytest.skip("this torch's gloo has no ReduceOp.AVG")
    _, _, check, words, _ = AVG["03 ReduceOp.AVG"]
    first_failure(text, "03 ReduceOp.AVG", check, words)


# ----- many solutions of one exercise, graded in one run on the same ranks -----
# Each class of mistake has several solutions; each must fail first the check named, with a reason
# that holds every one of the words and none of the absent ones. Each right solution, written in
# an unusual way, must pass every check. Each entry: name -> (exercise, edits of the reference
# solution, check, words, absent) for a wrong one; (exercise, edits) for a right one.

LOOP_07 = ("    optimizer.zero_grad()\n    for j, (x, y) in enumerate(micro_batches):\n"
           "        if j < k - 1:\n            with ddp.no_sync():\n"
           "                (F.mse_loss(ddp(x), y) / k).backward()\n        else:\n"
           "            (F.mse_loss(ddp(x), y) / k).backward()\n    optimizer.step()\n")


def loop_07(inside: str, last: str, before: str = "    optimizer.zero_grad()\n",
            after: str = "    optimizer.step()\n", over: str = "micro_batches",
            split: str = "j < k - 1") -> list[tuple[str, str]]:
    """The reference loop with its pieces replaced: the loss of the first k - 1 micro-batches
    (``inside``) and of the last, what comes before and after the loop, what it runs over."""
    return [(LOOP_07, f"{before}    for j, (x, y) in enumerate({over}):\n        if {split}:\n"
                      f"            with ddp.no_sync():\n                {inside}\n"
                      f"        else:\n            {last}\n{after}")]


DIST_07 = [("import torch.nn.functional as F\n",
            "import torch.distributed as dist\nimport torch.nn.functional as F\n")]
LOSS_07 = "(F.mse_loss(ddp(x), y) / k).backward()"
SYNC_07 = "the micro-batch that synchronizes is the last one"
BITS_07 = "2 ranks: parameters equal the correct loop's"
BITS3_07 = "3 ranks: parameters equal the correct loop's"
ROUND_07 = "one all_reduce round per step"

FLAT_03 = ("    world_size = dist.get_world_size()\n"
           "    grads = [p.grad for p in model.parameters() if p.grad is not None]\n"
           "    flat = torch.cat([g.reshape(-1) for g in grads])\n"
           "    flat.mul_(1.0 / world_size)\n    dist.all_reduce(flat)\n"
           "    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):\n"
           "        g.copy_(piece.view_as(g))\n")


def flat_03(body: str) -> list[tuple[str, str]]:
    """Exercise 03's solution with ``body`` in place of its own (and torch imported)."""
    return [(BODY_03, body), ("import torch.distributed as dist\n",
                              "import torch\nimport torch.distributed as dist\n")]


BODY_03 = "    world_size = dist.get_world_size()\n" + LOOP_03
ORDER_04 = "    order = (order * -(-total_size // dataset_len))[:total_size]\n"
EQUAL_04 = "every rank's indices equal torch's"
SHARE_15 = "each rank's optimizer holds its share only"
SEND_15 = "every broadcast sends a parameter from its owner"
OWNERS_15 = "owners: torch's ZeroRedundancyOptimizer's partition"
SEND_LOOP_15 = ("        for p, owner in zip(self.params, self.owners):\n"
                "            dist.broadcast(p, src=owner)\n")

CLASSES = {
    # 07, the loss's divisor: each named from the update's size, at k = 3 (and 2 ranks)
    "07 divided by the world size": (
        "07", DIST_07 + loop_07("(F.mse_loss(ddp(x), y) / dist.get_world_size()).backward()",
                                "(F.mse_loss(ddp(x), y) / dist.get_world_size()).backward()"),
        BITS_07, ["divided by the world size, not by k"], ["twice", "zero_grad once"]),
    "07 divided by k and the world size": (
        "07", DIST_07 + loop_07(
            "(F.mse_loss(ddp(x), y) / (k * dist.get_world_size())).backward()",
            "(F.mse_loss(ddp(x), y) / (k * dist.get_world_size())).backward()"),
        BITS_07, ["divided by k and by the world size", "already averages"],
        ["twice", "zero_grad once"]),
    "07 divided by k twice": (
        "07", loop_07("(F.mse_loss(ddp(x), y) / k / k).backward()",
                      "(F.mse_loss(ddp(x), y) / k / k).backward()"),
        BITS_07, ["divided by k twice"], ["world size", "zero_grad once"]),
    "07 the sum of the losses": (
        "07", loop_07("F.mse_loss(ddp(x), y).backward()", "F.mse_loss(ddp(x), y).backward()"),
        BITS_07, ["SUM of the micro-batches' gradients"], ["zero_grad once"]),
    "07 the last loss not divided": (
        "07", loop_07(LOSS_07, "F.mse_loss(ddp(x), y).backward()"),
        BITS_07, ["last micro-batch's loss", "was not divided by k"], ["zero_grad once"]),
    "07 only the last loss divided": (
        "07", loop_07("F.mse_loss(ddp(x), y).backward()", LOSS_07),
        BITS_07, ["only the last micro-batch's loss was divided by k"], ["zero_grad once"]),
    # 07, zero_grad and step in the wrong place
    "07 zero_grad never": (
        "07", loop_07(LOSS_07, LOSS_07, before=""), BITS_07,
        ["never called", "the first step was right"], ["zero_grad once"]),
    "07 zero_grad just before the step": (
        "07", loop_07(LOSS_07, LOSS_07, before="",
                      after="    optimizer.zero_grad()\n    optimizer.step()\n"),
        BITS_07, ["no parameter ever moved", "just before"], ["zero_grad once"]),
    "07 zero_grad before each micro-batch, inside the branch": (
        "07", loop_07("optimizer.zero_grad()\n                " + LOSS_07,
                      "optimizer.zero_grad()\n            " + LOSS_07, before=""),
        BITS_07, ["zero_grad() ran before every micro-batch"], ["zero_grad once"]),
    "07 a micro-batch left out": (
        "07", loop_07(LOSS_07, LOSS_07, over="micro_batches[1:]", split="j < k - 2"),
        BITS_07, ["first micro-batch was left out"], ["zero_grad once"]),
    # 07, the synchronization: launches counted per micro-batch, whichever way it ran
    "07 no no_sync at all": (
        "07", loop_07(LOSS_07, LOSS_07, split="False")
        + [("        else:\n", "        if True:\n")],
        ROUND_07, ["Every micro-batch synchronized", "[0, 0,"], []),
    "07 only the backward inside no_sync": (
        "07", [("            with ddp.no_sync():\n                " + LOSS_07,
                "            loss = F.mse_loss(ddp(x), y) / k\n            with ddp.no_sync():\n"
                "                loss.backward()")],
        ROUND_07, ["Every micro-batch synchronized", "read at forward time"], []),
    "07 every micro-batch inside no_sync": (
        "07", loop_07(LOSS_07, "with ddp.no_sync():\n                " + LOSS_07),
        ROUND_07, ["No micro-batch synchronized", "[0, 0, 0]"], []),
    "07 the last through ddp.module": (
        "07", loop_07(LOSS_07, "(F.mse_loss(ddp.module(x), y) / k).backward()"),
        ROUND_07, ["No micro-batch synchronized"], ["micro-batch 0 synchronized"]),
    "07 one micro-batch too early": (
        "07", loop_07(LOSS_07, LOSS_07, split="j < k - 2"),
        ROUND_07, ["Micro-batches [1] synchronized as well as the last"], []),
    # 15, the local optimizer's options, asynchronous broadcasts, a partition by bytes
    "15 built without the defaults": (
        "15", [("self.local = optimizer_class(mine, **defaults)",
                "self.local = optimizer_class(mine)")],
        SHARE_15, ["not the defaults given", "**defaults"], ["never stepped"]),
    "15 built with the learning rate only": (
        "15", [("self.local = optimizer_class(mine, **defaults)",
                "self.local = optimizer_class(mine, lr=defaults[\"lr\"])")],
        SHARE_15, ["'momentum': 0", "not the defaults given"], ["never stepped"]),
    "15 asynchronous broadcasts never waited for": (
        "15", [("dist.broadcast(p, src=owner)", "dist.broadcast(p, src=owner, async_op=True)")],
        SEND_15, ["never waited for", "work.wait()"], []),
    "15 asynchronous broadcasts, only the last waited for": (
        "15", [(SEND_LOOP_15, "        works = [dist.broadcast(p, src=owner, async_op=True)\n"
                              "                 for p, owner in zip(self.params, self.owners)]\n"
                              "        works[-1].wait()\n")],
        SEND_15, ["never waited for"], []),
    "15 balanced by bytes": (
        "15", [("load[result[i]] += params[i].numel()",
                "load[result[i]] += params[i].numel() * params[i].element_size()")],
        OWNERS_15, ["counted each rank's load in bytes", "whatever the shape and dtype"], []),
    "15 sorted and balanced by bytes": (
        "15", [("load[result[i]] += params[i].numel()",
                "load[result[i]] += params[i].numel() * params[i].element_size()"),
               ("key=lambda i: params[i].numel()",
                "key=lambda i: params[i].numel() * params[i].element_size()")],
        OWNERS_15, ["you balanced bytes"], []),
    # 03, one flat buffer: a wrong arithmetic named in that layout too
    "03 one flat buffer, divided after the sum": (
        "03", flat_03(FLAT_03.replace("flat.mul_(1.0 / world_size)\n    dist.all_reduce(flat)",
                                      "dist.all_reduce(flat)\n    flat.div_(world_size)")),
        WHICH_03, ["You divided the sum by world_size", "BEFORE the all_reduce"],
        ["none of", "neither"]),
    # 05: each rule named only when it is the learner's; '>=' said only of a comparison
    "05 one bucket for all dtypes": (
        "05", [("open_buckets.setdefault((p.dtype, p.device), [[], 0, 0])",
                "open_buckets.setdefault(p.device, [[], 0, 0])")],
        AT_LIMITS, ["one open bucket for all dtypes"], ["MORE", ">=", "at least its limit"]),
    "05 elements counted, not bytes": (
        "05", [("entry[1] += p.numel() * p.element_size()", "entry[1] += p.numel()")],
        AT_LIMITS, ["you counted elements"], ["MORE", ">=", "at least its limit"]),
    "05 four bytes an element": (
        "05", [("entry[1] += p.numel() * p.element_size()", "entry[1] += p.numel() * 4")],
        AT_LIMITS, ["4 bytes per element"], ["MORE", ">=", "at least its limit"]),
    "05 every bucket at the cap": (
        "05", [(CLOSE_05, "        if entry[1] >= cap_bytes:\n")],
        AT_LIMITS, ["every bucket closed at cap_bytes"], ["MORE", ">=", "at least its limit"]),
    "05 the first limit once overall": (
        "05", [(CLOSE_05, "        if entry[1] >= (first_bytes if not closed else cap_bytes):\n")],
        AT_LIMITS, ["first bucket of EACH dtype"], ["MORE", ">=", "at least its limit"]),
    "05 past the limit, written as not below it plus one": (
        "05", [(CLOSE_05, "        if entry[1] >= (first_bytes if entry[2] == 0 else cap_bytes) "
                          "+ 1:\n")],
        AT_LIMITS, ["MORE than its limit", "(>=)"], []),
    "05 sorted by the largest index": (
        "05", [("return list(reversed(sorted(closed, key=min)))",
                "return list(reversed(sorted(closed, key=max)))")],
        "the layout of torch's _compute_bucket_assignment_by_size",
        ["torch's buckets in another order", "smallest index"], ["opposite order"]),
    "05 in the order they closed": (
        "05", [("return list(reversed(sorted(closed, key=min)))", "return closed[::-1]")],
        "the layout of torch's _compute_bucket_assignment_by_size",
        ["torch's buckets in another order", "smallest index"], ["opposite order"]),
    "04 never shuffled": (
        "04", [("    if shuffle:\n", "    if False:\n")], EQUAL_04, ["You never shuffled"],
        ["contiguous"]),
    "04 always shuffled": (
        "04", [("    if shuffle:\n", "    if True:\n")], EQUAL_04,
        ["You shuffled with shuffle=False too"], ["contiguous"]),
    "15 the local step taken twice": (
        "15", [("        self.local.step()\n", "        self.local.step()\n"
                "        self.local.step()\n")],
        "2 ranks: parameters equal torch's", ["ran 2 times in one step"], []),
    # 04: the process-wide random state
    "04 reseeds torch's global RNG": (
        "04", [("        g = torch.Generator()\n        g.manual_seed(seed + epoch)\n"
                "        order = torch.randperm(dataset_len, generator=g).tolist()\n",
                "        torch.manual_seed(seed + epoch)\n"
                "        order = torch.randperm(dataset_len).tolist()\n")],
        "every rank's indices equal torch's", ["process-wide random state",
                                                "torch's default generator"], []),
    "04 draws from Python's random": (
        "04", [("        order = torch.randperm(dataset_len, generator=g).tolist()\n",
                "        order = torch.randperm(dataset_len, generator=g).tolist()\n"
                "        random.random()\n"),
               ("import torch\n", "import random\n\nimport torch\n")],
        "every rank's indices equal torch's", ["Python's random"], []),
    # 04: the padding, the cut and the count, each named from every case
    "04 padded with the last index": (
        "04", [(ORDER_04, "    order = (order + order[-1:] * (total_size - dataset_len))"
                          "[:total_size]\n")],
        EQUAL_04, ["repeating the last index"], ["contiguous"]),
    "04 padded once": (
        "04", [(ORDER_04, "    order = (order + order[:total_size - dataset_len])[:total_size]\n")],
        EQUAL_04, ["falls short when the padding is longer than the dataset"], ["contiguous"]),
    "04 never cut": (
        "04", [(ORDER_04, "    order = order * -(-total_size // dataset_len)\n"),
               ("return order[rank:total_size:num_replicas]", "return order[rank::num_replicas]")],
        EQUAL_04, ["not cut to total_size"], ["contiguous"]),
    "04 drop_last swapped": (
        "04", [("    if drop_last:\n", "    if not drop_last:\n")],
        EQUAL_04, ["You swapped drop_last's two cases"], ["contiguous"]),
    "04 one more than the floor": (
        "04", [("num_samples = -(-dataset_len // num_replicas)",
                "num_samples = dataset_len // num_replicas + 1")],
        EQUAL_04, ["one too many when the dataset splits evenly"], ["contiguous"]),
    # 03: a scale that is a number written in, named from the ratio to the mean
    "03 the world size written in as 2": (
        "03", [("p.grad.mul_(1.0 / world_size)", "p.grad.mul_(0.5)")],
        WHICH_03, ["the mean times 1.5", "dist.get_world_size()"], ["rounding-sized"]),
    # 15: the order of the local step and the broadcasts
    "15 broadcasts before the local step": (
        "15", [("        self.local.step()\n" + SEND_LOOP_15,
                SEND_LOOP_15 + "        self.local.step()\n")],
        "2 ranks: parameters equal torch's", ["before self.local.step()", "Step first"], []),
    # 06: more of what a reducer gets wrong
    "06 never scaled": (
        "06", [("torch.mul(param.grad, 1.0 / self.world_size, out=view)",
                "view.copy_(param.grad)")],
        "2 ranks: .grad equals torch's DDP's bit for bit", ["the SUM over the ranks"],
        ["Each gradient times the reciprocal"]),
    "06 in_flight never reset": (
        "06", [("        self.in_flight = []\n\n    def _record", "\n    def _record")],
        "every backward starts from a reset state", ["reset the state at the end of _finish"],
        []),
    "06 a bucket counted complete at its first gradient": (
        "06", [("self.missing[b] -= 1", "self.missing[b] = 0")],
        "every bucket is launched once all its gradients are in it",
        ["were not yet in it", "count of missing gradients"], []),
    # 07, the mean's value, rounded otherwise: at k = 3 scaling after the backwards shows
    "07 gradients divided by k before the step": (
        "07", loop_07("F.mse_loss(ddp(x), y).backward()", "F.mse_loss(ddp(x), y).backward()",
                      after="    for p in ddp.parameters():\n        p.grad.div_(k)\n"
                            "    optimizer.step()\n"),
        BITS_07, ["gradients were divided by k after the backwards", "Divide each loss by k"],
        ["none of the usual"]),
    "07 gradients multiplied by 1 / k before the step": (
        "07", loop_07("F.mse_loss(ddp(x), y).backward()", "F.mse_loss(ddp(x), y).backward()",
                      after="    for p in ddp.parameters():\n        p.grad *= 1 / k\n"
                            "    optimizer.step()\n"),
        BITS_07, ["multiplied by 1/k after the backwards"], ["none of the usual"]),
    # 07: every micro-batch's loss in one backward
    "07 the losses summed, one backward": (
        "07", [(LOOP_07, "    optimizer.zero_grad()\n"
                         "    losses = [F.mse_loss(ddp(x), y) / k for x, y in micro_batches]\n"
                         "    sum(losses).backward()\n    optimizer.step()\n")],
        BITS_07, ["one backward after all k forwards", "no_sync"], ["none of the usual"]),
}
RIGHT_CLASSES = {
    "15 one flat broadcast per owner": ("15", [(SEND_LOOP_15, (
        "        for r in range(self.world_size):\n"
        "            share = [p for p, o in zip(self.params, self.owners) if o == r]\n"
        "            flat = torch.cat([p.detach().reshape(-1) for p in share])\n"
        "            dist.broadcast(flat, src=r)\n"
        "            offset = 0\n"
        "            for p in share:\n"
        "                p.copy_(flat[offset:offset + p.numel()].view_as(p))\n"
        "                offset += p.numel()\n"))]),
    "06 copied back into a new tensor": ("06", [(
        "self.params[i].grad.copy_(self.views[i][1])",
        "self.params[i].grad = self.views[i][1].clone()")]),
    "07 the flag set by hand": ("07", [(LOOP_07, (
        "    optimizer.zero_grad()\n    for j, (x, y) in enumerate(micro_batches):\n"
        "        ddp.require_backward_grad_sync = j == k - 1\n"
        "        " + LOSS_07 + "\n    ddp.require_backward_grad_sync = True\n"
        "    optimizer.step()\n"))]),
    "03 p.grad rebound to a scaled copy": ("03", [(
        "        p.grad.mul_(1.0 / world_size)\n",
        "        p.grad = p.grad * (1.0 / world_size)\n")]),
    "15 the share from a generator": ("15", [(
        "self.local = optimizer_class(mine, **defaults)",
        "self.local = optimizer_class((p for p in mine), **defaults)")]),
    "04 the strided slice without its end": ("04", [(
        "return order[rank:total_size:num_replicas]", "return order[rank::num_replicas]")]),
    "04 the ceiling from math": ("04", [
        ("num_samples = -(-dataset_len // num_replicas)",
         "num_samples = math.ceil(dataset_len / num_replicas)"),
        ("import torch\n", "import math\n\nimport torch\n")]),
    "04 a generator from torch.Generator().manual_seed": ("04", [(
        "        g = torch.Generator()\n        g.manual_seed(seed + epoch)\n",
        "        g = torch.Generator().manual_seed(seed + epoch)\n")]),
    "05 bytes from the dtype's bits": ("05", [(
        "entry[1] += p.numel() * p.element_size()",
        "entry[1] += p.nelement() * torch.finfo(p.dtype).bits // 8")]),
    "03 one flat buffer, scaled, one all_reduce": ("03", flat_03(FLAT_03)),
    "03 one flat buffer, last parameter first": ("03", flat_03(FLAT_03.replace(
        "if p.grad is not None]", "if p.grad is not None][::-1]"))),
    "15 asynchronous broadcasts, all waited for": ("15", [(
        SEND_LOOP_15, "        works = [dist.broadcast(p, src=owner, async_op=True)\n"
                      "                 for p, owner in zip(self.params, self.owners)]\n"
                      "        for work in works:\n            work.wait()\n")]),
    "15 ties broken by index in the key": ("15", [(
        "sorted(range(len(params)), key=lambda i: params[i].numel(), reverse=True)",
        "sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))")]),
    "15 the least-loaded rank by min over ranks": ("15", [(
        "result[i] = load.index(min(load))",
        "result[i] = min(range(world_size), key=lambda r: load[r])")]),
    "15 a parameter group and .data sent": ("15", [
        ("self.local = optimizer_class(mine, **defaults)",
         "self.local = optimizer_class([{\"params\": mine}], **defaults)"),
        ("dist.broadcast(p, src=owner)", "dist.broadcast(p.data, src=owner)")]),
    "07 the first k - 1 through ddp.module": ("07", loop_07(
        "(F.mse_loss(ddp.module(x), y) / k).backward()", LOSS_07)),
    "07 zero_grad after the step": ("07", loop_07(
        LOSS_07, LOSS_07, before="", after="    optimizer.step()\n    optimizer.zero_grad()\n")),
    "07 times the reciprocal": ("07", loop_07("(F.mse_loss(ddp(x), y) * (1.0 / k)).backward()",
                                              "(F.mse_loss(ddp(x), y) * (1.0 / k)).backward()")),
    "07 one no_sync block, then the last": ("07", [(LOOP_07, (
        "    optimizer.zero_grad()\n    with ddp.no_sync():\n"
        "        for x, y in micro_batches[:-1]:\n            " + LOSS_07 + "\n"
        "    x, y = micro_batches[-1]\n    " + LOSS_07 + "\n    optimizer.step()\n"))]),
    "07 zeros kept, not None": ("07", loop_07(
        LOSS_07, LOSS_07, before="    optimizer.zero_grad(set_to_none=False)\n")),
}


def solution_files(names: list[str], directory: Path, tables: tuple[dict, ...]) -> list[Path]:
    """Write each named solution as ``directory/NN_<name>.py``; return their paths."""
    table = {k: v for t in tables for k, v in t.items()}
    paths = []
    for name in names:
        number, edits = table[name][:2]
        text = next(SOLUTIONS.glob(f"{number}_*.py")).read_text()
        for right, wrong in edits:
            assert text.count(right) == 1, f"{name}: the solution no longer holds {right!r}"
            text = text.replace(right, wrong)
        paths.append(directory / f"{number}_{re.sub(r'[^a-z0-9]+', '_', name.lower())}.py")
        paths[-1].write_text(text)
    return paths


def by_file(stdout: str) -> dict[str, str]:
    """The grader's output per graded file (by its name), each verdict on one line."""
    parts = re.split(r"^exercise \d\d[a-z]?: (.*)$", unwrapped(stdout), flags=re.MULTILINE)
    return {Path(path).name: text for path, text in zip(parts[1::2], parts[2::2])}


CLASS_NUMBERS = sorted({case[0] for case in (*CLASSES.values(), *RIGHT_CLASSES.values())})


def graded_in_one_run(solutions: dict, directory: Path) -> dict[str, str]:
    """Grade every solution of ``solutions`` (name -> (exercise, edits, ...)) in one grader run,
    all on the same ranks; each one's verdict, by name."""
    paths = solution_files(list(solutions), directory, (solutions,))
    done = grade(*paths, timeout=900)
    found = by_file(done.stdout)
    assert len(found) == len(paths), done.stdout + done.stderr
    return {name: found[path.name] for name, path in zip(solutions, paths)}


def problem(name: str, text: str, wrong: dict, right: dict) -> str | None:
    """What did not go as it must in one solution's verdict: a right one that did not pass, a
    wrong one whose first FAIL is not ``check`` with every one of ``words`` and none of
    ``absent`` in its reason."""
    if name in right:
        return None if "PASS" in text and "FAIL" not in text else \
            f"{name} (right) did not pass:\n{text}"
    _, _, check, words, absent = wrong[name]
    try:
        lines, failed = first_failure(text, name, check, words)
        why = lines[failed[0] + 1] if failed[0] + 1 < len(lines) else ""
        assert not any(w in why for w in absent), f"{name}: {why!r} holds one of {absent}"
    except AssertionError as error:
        return str(error)
    return None


def problems_in_one_run(wrong: dict, right: dict, directory: Path) -> list[str]:
    """Grade every solution of ``wrong`` (name -> (exercise, edits, check, words, absent)) and
    of ``right`` (name -> (exercise, edits)) in one grader run, all on the same ranks; what did
    not go as it must (:func:`problem`)."""
    found = graded_in_one_run({**wrong, **right}, directory)
    return [said for name, text in found.items() if (said := problem(name, text, wrong, right))]


#: Every table of solutions above, by a name of its own (a name can be in two tables)
TABLES = {
    "mistakes": {number: (number, [(right, wrong)]) for number, (right, wrong, _)
                 in MISTAKES.items()},
    "root causes": {case: (number, [(right, wrong)]) for case, (number, right, wrong, _, _)
                    in ROOT_CAUSES.items()},
    "wrong": WRONG, "right": {number: (number, edits) for number, edits in RIGHT.items()},
    "named": NAMED, "avg": AVG, "classes": CLASSES, "right classes": RIGHT_CLASSES,
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """``graded(table, name)``: the grader's verdict on that solution. Every solution of one
    exercise, of every table, is graded in one run on the same ranks (as a learner's several
    files are) when a test first asks for one of them: starting the grader and its ranks costs
    more than grading a solution, and is paid once per exercise."""
    verdicts: dict[str, dict] = {}

    def verdict(table: str, name: str) -> str:
        number = TABLES[table][name][0]
        if number not in verdicts:
            solutions = {(t, n): case for t, cases in TABLES.items() for n, case in cases.items()
                         if case[0] == number}
            directory = tmp_path_factory.mktemp(f"solutions_{number}")
            found = graded_in_one_run({f"{t} {n}": case for (t, n), case in solutions.items()},
                                      directory)
            verdicts[number] = {key: found[f"{key[0]} {key[1]}"] for key in solutions}
        return verdicts[number][(table, name)]

    return verdict


@pytest.mark.slow
@pytest.mark.parametrize("number", CLASS_NUMBERS)
def test_each_class_of_mistake_is_named_and_unusual_right_solutions_pass(graded, number):
    wrong = {name: case for name, case in CLASSES.items() if case[0] == number}
    right = {name: case for name, case in RIGHT_CLASSES.items() if case[0] == number}
    problems = [said for name in [*wrong, *right] if (said := problem(
        name, graded("classes" if name in wrong else "right classes", name), wrong, right))]
    assert not problems, "\n\n".join(problems)
