"""Run every lesson in order and say which ones passed.

    python lessons/run_course.py                  # every lessons/NN_*.py, from any directory
    python lessons/run_course.py 03 05            # only the lessons whose number is given
    python lessons/run_course.py --timeout 60 --lessons-dir path/to/lessons

Each lesson runs as its own process (``python NN_topic.py``), so it starts its own ranks exactly as
it does by hand. A lesson passes when it exits with status 0 and its last line starts with ``OK``.
A lesson still running after ``--timeout`` seconds is killed with every process it started. The
output of a failed lesson is shown (its last lines), then a summary table; the exit status is 1
when any lesson failed.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_lesson(path: Path, timeout: float) -> tuple[str, float, str]:
    """Run one lesson; return its result (OK, FAILED (exit N), TIMEOUT), seconds and output."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(path)], cwd=path.parent.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # lines in order
                            start_new_session=True)  # its own process group, to kill it whole
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return "TIMEOUT", time.perf_counter() - start, output
    seconds = time.perf_counter() - start
    lines = output.strip().splitlines()
    if proc.returncode != 0:
        return f"FAILED (exit {proc.returncode})", seconds, output
    if not lines or not lines[-1].startswith("OK"):
        return "FAILED (no OK line)", seconds, output
    return "OK", seconds, output


def main() -> int:
    parser = argparse.ArgumentParser(description="Run every lesson in order.")
    parser.add_argument("only", nargs="*", help="lesson numbers to run (default: all)")
    parser.add_argument("--lessons-dir", type=Path, default=HERE)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per lesson")
    args = parser.parse_args()

    lessons = sorted(args.lessons_dir.resolve().glob("[0-9][0-9]_*.py"))
    if args.only:
        lessons = [p for p in lessons if p.name[:2] in args.only]
    if not lessons:
        print(f"no lessons found in {args.lessons_dir} (looked for NN_*.py)")
        return 1

    results = []
    for path in lessons:
        print(f"--- {path.name}", flush=True)
        result, seconds, output = run_lesson(path, args.timeout)
        lines = output.strip().splitlines()
        if result == "OK":
            print(f"    {lines[-1]}", flush=True)
        else:
            print("\n".join("    | " + line for line in lines[-25:]), flush=True)
            print(f"    {result} after {seconds:.1f} s", flush=True)
        results.append((path.name, result, seconds))

    width = max(len(name) for name, _, _ in results)
    print(f"\n{'lesson':<{width}}  {'result':<18} {'seconds':>7}")
    for name, result, seconds in results:
        print(f"{name:<{width}}  {result:<18} {seconds:7.1f}")
    failed = [name for name, result, _ in results if result != "OK"]
    print(f"\n{len(results) - len(failed)} of {len(results)} lessons passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
