"""Grade the exercises in lessons/exercises/ bit for bit against torch.

Each exercise is a lesson's mechanism with its key lines removed and an instruction in their
place (it raises NotImplementedError until you write them). The grader runs your code on
several forked CPU ranks with gloo (miniddp.RankGroup, with timeouts), next to torch's own
DistributedDataParallel or DistributedSampler, and says which check failed and what was
expected. Where torch's bits cannot be expected, the check says why and what it asks instead.

    python lessons/grade.py                # grade your exercises as they stand
    python lessons/grade.py 06             # grade one (03 04 05 06 07 15 17 17b 18)
    python lessons/grade.py --hint 06      # if you are stuck: the idea behind one
    python lessons/grade.py --hint 06 --step 2   # then the shape of its code; --step 3 the lines
    python lessons/grade.py --dir D        # grade the files NN_*.py of directory D
    python lessons/grade.py D/06_a.py D/06_b.py  # grade these files (named NN_*.py), each
    python lessons/grade.py --solutions    # grade the reference solutions (all pass)

Several files of one exercise are graded on the same ranks, one after another, and torch's side
of each check (its reference training, the usual mistakes' results) is computed for the first
and kept for the rest: each further file costs only the running of its own code.

An exception in the grader's own code (on a rank with none of your code running, or in its
verdicts) is shown as ERROR with its traceback, apart from any verdict: it is the grader's fault,
not your solution's.

Exit status 0 when every graded exercise passes every check.
"""

import argparse
import importlib.util
import re
import sys
import textwrap
import traceback
from pathlib import Path

import torch  # noqa: E402

from course.grader import checks, hints  # noqa: E402
from course.grader.buckets import grade_05  # noqa: E402
from course.grader.fsdp import fully_shard, grade_17  # noqa: E402
from course.grader.fsdp_unit import grade_17b  # noqa: E402
from course.grader.hsdp import grade_18  # noqa: E402
from course.grader.no_sync import grade_07  # noqa: E402
from course.grader.reducer import grade_06  # noqa: E402
from course.grader.sampler import grade_04  # noqa: E402
from course.grader.zero import grade_15  # noqa: E402
from miniddp.launch import RankError  # noqa: E402

EXERCISES = Path(__file__).resolve().parents[2] / "lessons" / "exercises"
GRADERS = {"03": checks.grade_03, "04": grade_04, "05": grade_05, "06": grade_06,
           "07": grade_07, "15": grade_15}
if fully_shard is not None:  # exercise 17 is graded against torch's FSDP2 (torch >= 2.4)
    GRADERS.update({"17": grade_17, "17b": grade_17b, "18": grade_18})

# Each exercise's hint in steps: the idea, the shape of the code, its lines (hints.py)
HINTS = hints.HINTS
STEPS = ("the idea", "the shape of the code", "the lines of code")


#: Verdicts are wrapped at this width; a continued line is indented by HANG spaces (the tests
#: join such lines back onto the one before)
WIDTH, HANG = 100, 10


def say(label: str, text: str) -> None:
    """Print ``text`` after ``label`` (its indent and tag), wrapped with a hanging indent."""
    print(textwrap.fill(text, WIDTH, initial_indent=label, subsequent_indent=" " * HANG,
                        break_long_words=False, break_on_hyphens=False), flush=True)


def number_of(path: Path) -> str:
    """The exercise a file named ``NN_*.py`` or ``NNx_*.py`` is for (``17b_fsdp_unit.py``)."""
    found = re.match(r"(\d\d[a-z]?)_", path.name)
    return found.group(1) if found else path.name[:2]


def exercise_path(number: str, directory: Path) -> Path | None:
    found = sorted(directory.glob(f"{number}_*.py"))
    return found[0] if found else None


def learner_frames(details: str, path: Path) -> list[str]:
    """The traceback's last frames in the learner's file, as 'file:line in function: code'."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*([^\n]*)', details)
    shown = [f"{Path(file).name}:{line} in {function}: {code.strip()}"
             for file, line, function, code in frames if Path(file).resolve() == path.resolve()]
    return shown[-2:]


def load(path: Path, name: str) -> None:
    """Import the exercise file as ``name``; kept in sys.modules so that forked ranks find it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)




GRADER_ERROR = "GraderError: "


def grader_failed(where: str, details: str) -> None:
    """Say that the grader itself failed, apart from any verdict, with its traceback."""
    say("  ERROR ", f"the grader itself failed ({where}), in its own code with none of yours "
        "running: this is no verdict on your solution. Please report it, with this traceback:")
    for line in details.strip().splitlines():
        print(" " * (HANG + 2) + line, flush=True)  # deeper than a wrapped verdict line


def own_failure(details: str) -> str:
    """A rank's report, without the other ranks' lines that follow it."""
    return details.split("\n(then ", 1)[0]


def grade(number: str, path: Path, load_error: str | None) -> bool:
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    print(f"\nexercise {number}: {shown}", flush=True)
    if load_error:
        say("  FAIL  ", f"the file does not import: {load_error}")
        return False
    passed = True
    try:
        for ok, what, why in GRADERS[number]():
            passed &= ok
            say(f"  {'PASS' if ok else 'FAIL'}  ", what)
            if not ok:
                say(" " * 8, why)
    except checks.NotWritten as todo:
        say("  TODO  ", f"not written yet: {todo}")
        return False
    except checks.OutOfStep as mismatch:
        say("  FAIL  ", "every rank makes the same collective calls, in the same order")
        say(" " * 8, str(mismatch))
        return False
    except RankError as error:
        if GRADER_ERROR in own_failure(error.details):
            grader_failed(f"on rank {error.rank} of {error.world_size}",
                          own_failure(error.details).split(GRADER_ERROR, 1)[1])
            return False
        lines = [line for line in error.details.strip().splitlines()
                 if line.strip() and not line.startswith("(then")]
        say("  FAIL  ", f"rank {error.rank} of {error.world_size} raised: {lines[-1]}")
        for frame in learner_frames(error.details, path):
            say(" " * 8, f"at {frame}")
        # gloo says "Timed out waiting 20000ms for recv", or "Application timeout caused pair
        # closure": neither names the rank that never came (the collectives compared before
        # each call, SameCalls, do)
        if any(word in error.details.lower() for word in ("timed out", "timeout")):
            say(" " * 8, f"a collective waited {checks.PG_TIMEOUT_S} s for the other ranks and "
                "gave up: some rank never made the call this one made. Every rank must make "
                "the same collective calls in the same order")
        return False
    except Exception:  # the grader's own code, in this process: its verdicts, its harness
        grader_failed("while judging", traceback.format_exc())
        return False
    return passed


def hint(number: str, step: int) -> None:
    steps = HINTS[number] if isinstance(HINTS[number], tuple) else (HINTS[number],)
    step = min(step, len(steps))
    print(f"exercise {number}, hint {step} of {len(steps)}: {STEPS[step - 1]}\n")
    print(textwrap.fill(steps[step - 1], WIDTH) if step < len(steps) else steps[step - 1])
    if step < len(steps):
        print(f"\nStill stuck after trying? python lessons/grade.py --hint {number} --step "
              f"{step + 1} gives {STEPS[step]}.")


def grade_all(chosen: list[tuple[str, Path]]) -> list[bool]:
    """Grade each (exercise number, file); every file is loaded before any rank is forked, so
    that the ranks find each one, and ``checks.ALIASES`` points ``exercise_NN`` at one."""
    torch.set_num_threads(1)
    loaded = []
    for k, (number, path) in enumerate(chosen):
        name = f"exercise_{number}_{k}"
        try:
            load(path, name)
            loaded.append((number, path, name, None))
        except Exception as error:
            loaded.append((number, path, name, f"{type(error).__name__}: {error}"))
    results = []
    try:
        for number, path, name, error in loaded:
            if error is None:
                sys.modules[f"exercise_{number}"] = sys.modules[name]
                checks.ALIASES[f"exercise_{number}"] = name
            results.append(grade(number, path, error))
    finally:
        checks.close_groups()
    return results


def grade_files(parser, files: list[Path]) -> None:
    """Grade each file as the exercise its name starts with; exit 0 when all pass."""
    chosen = [(number_of(f), f) for f in files]
    wrong = [str(f) for (n, f) in chosen if n not in GRADERS or not f.is_file()]
    if wrong:
        parser.error(f"not a file named NN_*.py for an exercise ({' '.join(GRADERS)}): "
                     f"{', '.join(wrong)}")
    results = grade_all(chosen)
    print(f"\n{sum(results)} of {len(results)} files pass")
    sys.exit(0 if all(results) else 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercises", nargs="*",
                        help=f"which to grade ({' '.join(GRADERS)}), or files named NN_*.py")
    parser.add_argument("--solutions", action="store_true",
                        help="grade the reference solutions instead of your exercises")
    parser.add_argument("--dir", type=Path, default=None,
                        help="grade the files NN_*.py of this directory instead")
    parser.add_argument("--hint", metavar="NN", choices=list(HINTS),
                        help="print the idea behind exercise NN and stop")
    parser.add_argument("--step", type=int, choices=(1, 2, 3), default=1,
                        help="with --hint: 1 the idea, 2 the shape of the code, 3 its lines")
    args = parser.parse_args()
    if args.hint:
        hint(args.hint, args.step)
        return
    files = [Path(a) for a in args.exercises if a.endswith(".py")]
    args.exercises = [a for a in args.exercises if not a.endswith(".py")]
    if files:
        grade_files(parser, files)
    unknown = [n for n in args.exercises if n not in GRADERS]
    if unknown:
        parser.error(f"no exercise {', '.join(unknown)}; there are {', '.join(GRADERS)}")
    directory = args.dir or (EXERCISES / "solutions" if args.solutions else EXERCISES)
    paths = {n: exercise_path(n, directory) for n in args.exercises or GRADERS}
    absent = [n for n, path in paths.items() if path is None]
    if absent and (args.exercises or len(absent) == len(paths)):
        parser.error(f"no file {' or '.join(f'{n}_*.py' for n in absent)} in {directory}")
    if absent:
        print(f"(no file {', '.join(f'{n}_*.py' for n in absent)} in {directory}: not graded)")
    chosen = [n for n in paths if n not in absent]
    results = dict(zip(chosen, grade_all([(n, paths[n]) for n in chosen])))
    passed = [n for n, ok in results.items() if ok]
    flags = (" --solutions" if args.solutions and not args.dir else "") + \
        (f" --dir {args.dir}" if args.dir else "")
    print(f"\n{len(passed)} of {len(chosen)} exercises pass"
          + ("" if len(passed) == len(chosen) else
             f"; next: python lessons/grade.py {next(n for n in chosen if n not in passed)}"
             f"{flags}"))
    sys.exit(0 if len(passed) == len(chosen) else 1)


if __name__ == "__main__":
    main()
