#!/usr/bin/env bash
# Set up a fresh machine (CPU build of torch where there is no GPU, this project with its test extras)
# and run ruff and the whole test suite. Extra arguments go to pytest, e.g. ./run-tests.sh -m "not slow".
# MEGATRAIN_TEST_WORKERS=N runs the suite in N pytest-xdist workers (tests/conftest.py says how the work is
# split and what must not run side by side). The default is one process: on 2 cores the suite is CPU-bound,
# two workers are barely faster than one, and a test that times the end of a run to 10 s fails under their
# load. The GPU tests share one device and measure its memory: keep them in one process.
set -euo pipefail
cd "$(dirname "$0")"
MEGATRAIN_EXTRAS=test
source ./bootstrap.sh
megatrain_env
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# -X faulthandler: a crash after the last test (at the interpreter's exit) still prints every thread's stack.
"$PY" -X faulthandler -m pytest -q -n "${MEGATRAIN_TEST_WORKERS:-0}" --dist loadgroup --no-loadscope-reorder "$@"
