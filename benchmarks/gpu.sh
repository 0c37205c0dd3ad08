#!/usr/bin/env bash
# One command on a GPU machine: the CUDA tests, every benchmark, a one-screen summary.
# See benchmarks/gpu.py (this only finds the repository and runs it); --help for the flags.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$root/benchmarks/gpu.py" "$@"
