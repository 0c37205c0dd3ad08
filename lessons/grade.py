"""Grade the exercises in lessons/exercises/ bit for bit against torch.

Each exercise is a lesson's mechanism with its key lines removed and an instruction in their
place (it raises NotImplementedError until you write them). The grader runs your code on
several forked CPU ranks with gloo (miniddp.RankGroup, with timeouts), next to torch's own
DistributedDataParallel or DistributedSampler, and says which check failed and what was
expected. Where torch's bits cannot be expected, the check says why and what it asks instead.

    python lessons/grade.py                # grade your exercises as they stand
    python lessons/grade.py 06             # grade one (03 04 05 06 07 15 17)
    python lessons/grade.py --hint 06      # the code-level steps of one, if you are stuck
    python lessons/grade.py --dir D        # grade the files NN_*.py of directory D
    python lessons/grade.py --solutions    # grade the reference solutions (all pass)

Exit status 0 when every graded exercise passes every check.
"""

import argparse
import importlib.util
import os
import re
import sys
import textwrap
from pathlib import Path

# Before torch loads: its C++ note that find_unused_parameters found nothing unused (exercise
# 05 uses that flag for its buckets) would bury the grades.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import grading_checks as checks  # noqa: E402
import torch  # noqa: E402
from grading_fsdp import HINT_17, grade_17  # noqa: E402
from grading_reducer import grade_06  # noqa: E402
from grading_zero import HINT_15, grade_15  # noqa: E402

from miniddp.launch import RankError  # noqa: E402

EXERCISES = Path(__file__).resolve().parent / "exercises"
GRADERS = {"03": checks.grade_03, "04": checks.grade_04, "05": checks.grade_05, "06": grade_06,
           "07": checks.grade_07, "15": grade_15, "17": grade_17}

# The code-level steps behind each instruction, for --hint: the instructions say what must be
# true; these say how, for a learner who is stuck.
HINTS = {
    "03": """For each parameter with a gradient, two in-place calls:
    p.grad.mul_(1.0 / world_size)   # the reciprocal first: torch's arithmetic
    dist.all_reduce(p.grad)         # a SUM over the ranks, written into p.grad""",
    "04": """Step 1: g = torch.Generator(); g.manual_seed(seed + epoch);
    order = torch.randperm(dataset_len, generator=g).tolist()
Steps 2 and 3:
    num_samples = dataset_len // num_replicas if drop_last
                  else -(-dataset_len // num_replicas)      # ceil in integers
    total_size = num_samples * num_replicas
    repeat `order` from its start until it holds total_size indices, cut it to total_size
    return order[rank:total_size:num_replicas]""",
    "05": """In the loop:
    entry[0].append(i); entry[1] += p.numel() * p.element_size()
    if entry[1] >= (first_bytes if entry[2] == 0 else cap_bytes):
        closed.append(entry[0]); entry[0], entry[1] = [], 0; entry[2] += 1
After it:
    closed += [members for members, _, _ in open_buckets.values() if members]
    return list(reversed(sorted(closed, key=min)))""",
    "06": """_on_ready:
    torch.mul(param.grad, 1.0 / self.world_size, out=view)
    self.missing[b] -= 1
    while len(self.in_flight) < len(self.buckets) and self.missing[len(self.in_flight)] == 0:
        k = len(self.in_flight)
        self._record("launch", k)
        self.in_flight.append(dist.all_reduce(self.flat[k], async_op=True))
        if k == len(self.buckets) - 1:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
_finish:
    for each bucket b and its work in self.in_flight: work.wait(), then for each i in
    self.buckets[b]: self.params[i].grad.copy_(self.views[i][1])
    self.missing = [len(m) for m in self.buckets]; self.in_flight = []""",
    "07": """optimizer.zero_grad()
for j, (x, y) in enumerate(micro_batches):
    with ddp.no_sync() if j < k - 1 else contextlib.nullcontext():
        (F.mse_loss(ddp(x), y) / k).backward()
optimizer.step()""",
    "15": HINT_15,
    "17": HINT_17,
}


#: Verdicts are wrapped at this width; a continued line is indented by HANG spaces (the tests
#: join such lines back onto the one before)
WIDTH, HANG = 100, 10


def say(label: str, text: str) -> None:
    """Print ``text`` after ``label`` (its indent and tag), wrapped with a hanging indent."""
    print(textwrap.fill(text, WIDTH, initial_indent=label, subsequent_indent=" " * HANG,
                        break_long_words=False, break_on_hyphens=False), flush=True)


def exercise_path(number: str, directory: Path) -> Path | None:
    found = sorted(directory.glob(f"{number}_*.py"))
    return found[0] if found else None


def learner_frames(details: str, path: Path) -> list[str]:
    """The traceback's last frames in the learner's file, as 'file:line in function: code'."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*([^\n]*)', details)
    shown = [f"{Path(file).name}:{line} in {function}: {code.strip()}"
             for file, line, function, code in frames if Path(file).resolve() == path.resolve()]
    return shown[-2:]


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
    return passed


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercises", nargs="*", help=f"which to grade ({' '.join(GRADERS)})")
    parser.add_argument("--solutions", action="store_true",
                        help="grade the reference solutions instead of your exercises")
    parser.add_argument("--dir", type=Path, default=None,
                        help="grade the files NN_*.py of this directory instead")
    parser.add_argument("--hint", metavar="NN", choices=list(HINTS),
                        help="print the code-level steps of exercise NN and stop")
    args = parser.parse_args()
    if args.hint:
        print(f"exercise {args.hint}, the code-level steps (try without them first):\n")
        print(HINTS[args.hint])
        return
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
    torch.set_num_threads(1)
    loaded = {}
    for n in chosen:  # all before any rank is forked: the ranks must find every exercise
        try:
            load(paths[n], n)
            loaded[n] = (paths[n], None)
        except Exception as error:
            loaded[n] = (paths[n], f"{type(error).__name__}: {error}")
    try:
        results = {n: grade(n, *loaded[n]) for n in chosen}
    finally:
        checks.close_groups()
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
