#!/usr/bin/env bash
# Set up a fresh machine (CPU build of torch where there is no GPU, this project with its test extras)
# and run ruff and the whole test suite. Extra arguments go to pytest, e.g. ./run-tests.sh -m "not slow".
set -euo pipefail
cd "$(dirname "$0")"
MEGATRAIN_EXTRAS=test
source ./bootstrap.sh
megatrain_env
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m pytest -q "$@"
