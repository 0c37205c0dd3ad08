"""Run every lesson in order: watch each one's story as it runs, then a table of results.

    python lessons/run_course.py                  # every lessons/NN_*.py, from any directory
    python lessons/run_course.py 03 05            # only the lessons whose number is given
    python lessons/run_course.py --quiet          # only the table (and why any did not pass)
    python lessons/run_course.py --timeout 60 --lessons-dir path/to/lessons

Each lesson runs as its own process (``python NN_topic.py``), so it starts its own ranks exactly as
it does by hand, and everything it prints is shown as it comes, indented under its name. A lesson
passes when it exits with status 0 and its last line starts with ``OK``; one that exits with 0
after a last line starting ``SKIPPED:`` could not run here (lesson 16 on a torch older than 2.3)
and is listed with its reason, not failed. A lesson still running after ``--timeout`` seconds is
killed with every process it started.

When a lesson fails, the line that matters can be far up its output, above a launcher's report
(torchrun's is 20 lines of boilerplate), so the runner finds it: the failed check's message (or
else the error that ended the lesson) and the rank it came from, which miniddp's launchers print
as ``rank R of W raised:`` before a rank's traceback. It is shown under the lesson and again under
the table. The exit status is 1 when any lesson failed.

Beside each lesson's seconds, measured as it ran, the table shows the time its docstring claims
("About N s"): a measurement to compare, not a test. A lesson far over its claim on a quiet
machine has a claim to correct.
"""

import argparse
import ast
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

LESSONS = Path(__file__).resolve().parents[1] / "lessons"
INDENT = "    "
# Prefixes that relays put before a line: "[torchrun] ", "[agent 1] ", torch's "[rank1]: ".
RELAY_PREFIX = re.compile(r"^(?:\[[^\]\n]{1,40}\]:? ?)+")
ERROR_LINE = re.compile(r"^([\w.]*\w(?:Error|Exception|Failed|Interrupt|Exit))(?:: ?(.*))?$")
RANK_LINE = re.compile(r"\brank (\d+ of \d+) raised\b")
OTHER_RANK = re.compile(r"(?:^|; )rank (\d+) (raised|died without reporting): ")
# Errors that only say that another one happened: the rank's own error is the one to show.
WRAPPERS = ("RankError", "ChildFailedError")


CLAIM = re.compile(r"\bAbout (\d+) s\b")


def claimed_seconds(path: Path) -> int | None:
    """The time a lesson's docstring claims, "About N s", read without running it."""
    try:
        found = CLAIM.search(ast.get_docstring(ast.parse(path.read_text())) or "")
    except SyntaxError:
        return None
    return int(found.group(1)) if found else None


def first_error(lines: list[str]) -> str | None:
    """The first ``CheckFailed`` in ``lines``, else the first error with a message that is not
    a wrapper's, as ``Name: message``; None if there is neither."""
    errors = [m for line in lines if (m := ERROR_LINE.match(line))
              and m.group(2) and m.group(1).rsplit(".", 1)[-1] not in WRAPPERS]
    checks = [m for m in errors if m.group(1).endswith("CheckFailed")]
    if not (checks or errors):
        return None
    error = (checks or errors)[0]
    return f"{error.group(1).rsplit('.', 1)[-1]}: {error.group(2)}"


def each_rank(clean: list[str]) -> dict[str, str]:
    """Every rank's own failure, ``"R of W" -> "Name: message"``: from the lines after each
    ``rank R of W raised`` (torchrun's workers print one each), and from the
    ``(then rank R raised: ...)`` line in which miniddp's launcher lists the other ranks."""
    starts = [(i, m.group(1)) for i, line in enumerate(clean) if (m := RANK_LINE.search(line))]
    found: dict[str, str] = {}
    for n, (start, rank) in enumerate(starts):
        end = starts[n + 1][0] if n + 1 < len(starts) else len(clean)
        block = clean[start + 1:end]
        error = first_error(block)
        if error and rank not in found:
            found[rank] = error
        world = rank.split(" of ")[1]
        for line in block:
            if line.startswith("(then ") and line.endswith(")"):
                text = line[len("(then "):-1]
                marks = list(OTHER_RANK.finditer(text))
                for k, mark in enumerate(marks):
                    said = text[mark.end():marks[k + 1].start() if k + 1 < len(marks) else None]
                    said = said.rstrip("; ")
                    error = first_error([said]) or f"{mark.group(2)}: {said}"
                    found.setdefault(f"{mark.group(1)} of {world}", error)
    return found


def why_it_failed(lines: list[str]) -> str:
    """Why a lesson failed, found in its output: the failed check's message and the rank it
    came from, then the first line of every other rank's failure, one line each.

    The headline is the first ``CheckFailed`` line if there is one (a rank's own failure comes
    before what it did to the others); else the first error with a message that is not a
    wrapper's; else the last line printed. Its rank is the nearest ``rank R of W raised`` line
    above it. Every rank is shown because the first to fail is not always the one that names
    the cause.
    """
    clean = [RELAY_PREFIX.sub("", line).strip() for line in lines]
    headline = first_error(clean)
    if headline is None:
        return next((line for line in reversed(clean) if line), "(no output)")
    at = next(i for i, line in enumerate(clean) if (m := ERROR_LINE.match(line))
              and f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}" == headline)
    rank = next((m.group(1) for line in reversed(clean[:at]) if (m := RANK_LINE.search(line))),
                None)
    others = [f"rank {r}: {error}" for r, error in
              sorted(each_rank(clean).items(), key=lambda item: int(item[0].split()[0]))
              if r != rank]
    return "\n".join([f"{f'rank {rank}: ' if rank else ''}{headline}", *others])


def skipped_because(lines: list[str]) -> str:
    """A skipped lesson's reason: its last line, after ``SKIPPED:``."""
    return [line for line in lines if line.strip()][-1].split(":", 1)[1].strip()


def indented(why: str) -> str:
    """A reason of several lines (one per rank), its later lines indented under the first."""
    return why.replace("\n", "\n" + INDENT + "  ")


def run_lesson(path: Path, timeout: float, show) -> tuple[str, float, list[str]]:
    """Run one lesson, passing each line of its output to ``show`` as it comes; return its
    result (OK, SKIPPED, FAILED (exit N), FAILED (no OK line), TIMEOUT), seconds and output
    lines."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(path)], cwd=path.parent.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # lines in order
                            start_new_session=True)  # its own process group, to kill it whole
    lines: list[str] = []

    def relay():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            show(lines[-1])

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        return "TIMEOUT", time.perf_counter() - start, lines
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the lesson left behind
        except ProcessLookupError:
            pass
    reader.join(5)
    seconds = time.perf_counter() - start
    printed = [line for line in lines if line.strip()]
    if proc.returncode != 0:
        return f"FAILED (exit {proc.returncode})", seconds, lines
    if printed and printed[-1].startswith("SKIPPED:"):
        return "SKIPPED", seconds, lines
    if not printed or not printed[-1].startswith("OK"):
        return "FAILED (no OK line)", seconds, lines
    return "OK", seconds, lines


def main() -> int:
    parser = argparse.ArgumentParser(description="Run every lesson in order.")
    parser.add_argument("only", nargs="*", help="lesson numbers to run (default: all)")
    parser.add_argument("--lessons-dir", type=Path, default=LESSONS)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per lesson")
    parser.add_argument("--quiet", action="store_true",
                        help="show only the table, and why a lesson failed or was skipped")
    args = parser.parse_args()

    lessons = sorted(args.lessons_dir.resolve().glob("[0-9][0-9]_*.py"))
    if args.only:
        lessons = [p for p in lessons if p.name[:2] in args.only]
    if not lessons:
        print(f"no lessons found in {args.lessons_dir} (looked for NN_*.py)")
        return 1

    show = (lambda line: None) if args.quiet else (lambda line: print(INDENT + line, flush=True))
    results = []
    for path in lessons:
        if not args.quiet:
            print(f"\n=== {path.name}", flush=True)
        result, seconds, lines = run_lesson(path, args.timeout, show)
        why = ("" if result == "OK" else skipped_because(lines) if result == "SKIPPED"
               else why_it_failed(lines))
        if not args.quiet:
            print(f"=== {path.name}: {result} after {seconds:.1f} s"
                  + (f"\n{INDENT}why: {indented(why)}" if why else ""), flush=True)
        results.append((path.name, result, seconds, why))

    width = max(len(name) for name, *_ in results)
    claims = {path.name: claimed_seconds(path) for path in lessons}
    print(f"\n{'lesson':<{width}}  {'result':<18} {'seconds':>7}  {'claimed':>7}")
    for name, result, seconds, _ in results:
        claim = claims[name]
        print(f"{name:<{width}}  {result:<18} {seconds:7.1f}  "
              f"{'-' if claim is None else f'about {claim}':>7}")
    failed = [(name, why) for name, result, _, why in results if result not in ("OK", "SKIPPED")]
    skipped = [(name, why) for name, result, _, why in results if result == "SKIPPED"]
    passed = len(results) - len(failed) - len(skipped)
    print(f"\n{passed} of {len(results)} lessons passed"
          + (f", {len(skipped)} skipped ({', '.join(name for name, _ in skipped)})"
             if skipped else "")
          + (f"; failed: {', '.join(name for name, _ in failed)}" if failed else ""))
    for name, why in skipped:
        print(f"{name} (skipped): {why}")
    for name, why in failed:
        print(f"{name}: {indented(why)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
