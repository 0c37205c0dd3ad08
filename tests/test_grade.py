"""lessons/grade.py: shipped exercises fail saying what to write, solutions pass, and a wrong
solution fails the check that names its mistake."""

import os
import re
import subprocess
import sys

import pytest
from lesson_modules import LESSONS_DIR

GRADE = LESSONS_DIR / "grade.py"
SOLUTIONS = LESSONS_DIR / "exercises" / "solutions"
NUMBERS = ["03", "04", "05", "06", "07", "15"]


def grade(*args, timeout=240):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, str(GRADE), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=LESSONS_DIR.parent, env=env)


def sections(stdout: str) -> dict[str, str]:
    """The grader's output, exercise by exercise."""
    parts = re.split(r"^exercise (\d\d): .*$", stdout, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def solution_lines(number: str) -> list[str]:
    """The reference solution's lines of code that the exercise leaves out."""
    exercise = next((LESSONS_DIR / "exercises").glob(f"{number}_*.py")).read_text()
    solution = next(SOLUTIONS.glob(f"{number}_*.py")).read_text()
    return [line.strip() for line in solution.splitlines()
            if len(line.strip()) > 12 and line not in exercise and line.strip()[0] not in "\"#"]


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
def test_each_wrong_solution_fails_the_check_that_names_its_mistake(tmp_path):
    for number, (right, wrong, _) in MISTAKES.items():
        solution = next(SOLUTIONS.glob(f"{number}_*.py"))
        text = solution.read_text()
        assert right in text, f"{solution.name} no longer contains {right!r}"
        (tmp_path / solution.name).write_text(text.replace(right, wrong))
    done = grade("--dir", tmp_path)
    assert done.returncode == 1
    found = sections(done.stdout)
    for number, (_, _, check) in MISTAKES.items():
        failed = [line for line in found[number].splitlines() if line.strip().startswith("FAIL")]
        assert any(check in line for line in failed), f"{number}:\n{found[number]}"


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
def test_a_wrong_solution_fails_naming_its_root_cause(tmp_path, case):
    number, right, wrong, check, words = ROOT_CAUSES[case]
    solution = next(SOLUTIONS.glob(f"{number}_*.py"))
    text = solution.read_text()
    assert right in text, f"{solution.name} no longer contains {right!r}"
    (tmp_path / solution.name).write_text(text.replace(right, wrong))
    done = grade(number, "--dir", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = sections(done.stdout)[number].splitlines()
    failed = [k for k, line in enumerate(lines) if line.strip().startswith("FAIL")]
    assert failed and check in lines[failed[0]], done.stdout
    assert words in lines[failed[0] + 1], done.stdout


def test_hint_prints_the_code_the_instruction_leaves_out():
    done = grade("--hint", "03")
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(line in done.stdout for line in solution_lines("03")), done.stdout
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
