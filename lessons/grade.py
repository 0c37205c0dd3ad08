"""Grade the exercises in ``lessons/exercises/`` bit for bit against torch.

Each exercise is a lesson's mechanism with its key lines removed and an instruction in their
place (it raises ``NotImplementedError`` until you write them). The grader runs your code on
several forked CPU ranks with gloo (``miniddp.RankGroup``, with timeouts), next to torch's own
``DistributedDataParallel`` or ``DistributedSampler``, and says which check failed and what was
expected. Where torch's bits cannot be expected, the check says why and what it asks instead.

    python lessons/grade.py                # grade your exercises as they stand
    python lessons/grade.py 06             # grade one (03 04 05 06 07)
    python lessons/grade.py --solutions    # grade the reference solutions (all pass)

Exit status 0 when every graded exercise passes every check.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from grading_checks import GRADERS, NotWritten, close_groups

from miniddp.launch import RankError

EXERCISES = Path(__file__).resolve().parent / "exercises"


def exercise_path(number: str, directory: Path) -> Path:
    found = sorted(directory.glob(f"{number}_*.py"))
    if not found:
        raise FileNotFoundError(f"no file {number}_*.py in {directory}")
    return found[0]


def load(path: Path, number: str) -> None:
    """Import the exercise file; kept in sys.modules so that forked ranks can find it."""
    name = f"exercise_{number}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)




def grade(number: str, path: Path, load_error: str | None) -> bool:
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    print(f"\nexercise {number}: {shown}", flush=True)
    if load_error:
        print(f"  FAIL  the file does not import: {load_error}")
        return False
    passed = True
    try:
        for ok, what, why in GRADERS[number]():
            passed &= ok
            print(f"  {'PASS' if ok else 'FAIL'}  {what}" + ("" if ok else f"\n        {why}"),
                  flush=True)
    except NotWritten as todo:
        print(f"  TODO  not written yet: {todo}")
        return False
    except RankError as error:
        lines = [line for line in error.details.strip().splitlines()
                 if line.strip() and not line.startswith("(then")]
        print(f"  FAIL  rank {error.rank} of {error.world_size} raised: {lines[-1]}")
        return False
    return passed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exercises", nargs="*", help=f"which to grade ({' '.join(GRADERS)})")
    parser.add_argument("--solutions", action="store_true",
                        help="grade the reference solutions instead of your exercises")
    parser.add_argument("--dir", type=Path, default=None,
                        help="grade the files NN_*.py of this directory instead")
    args = parser.parse_args()
    unknown = [n for n in args.exercises if n not in GRADERS]
    if unknown:
        parser.error(f"no exercise {', '.join(unknown)}; there are {', '.join(GRADERS)}")
    torch.set_num_threads(1)
    chosen = args.exercises or list(GRADERS)
    directory = args.dir or (EXERCISES / "solutions" if args.solutions else EXERCISES)
    loaded = {}
    for n in chosen:  # all before any rank is forked: the ranks must find every exercise
        path = exercise_path(n, directory)
        try:
            load(path, n)
            loaded[n] = (path, None)
        except Exception as error:
            loaded[n] = (path, f"{type(error).__name__}: {error}")
    try:
        results = {n: grade(n, *loaded[n]) for n in chosen}
    finally:
        close_groups()
    passed = [n for n, ok in results.items() if ok]
    print(f"\n{len(passed)} of {len(chosen)} exercises pass"
          + ("" if len(passed) == len(chosen) else
             f"; next: python lessons/grade.py {next(n for n in chosen if n not in passed)}"))
    sys.exit(0 if len(passed) == len(chosen) else 1)


if __name__ == "__main__":
    main()
