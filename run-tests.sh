#!/usr/bin/env bash
# Set up a fresh machine (CPU build of torch, this project with its test extras) and run the tests.
# Extra arguments go to pytest, e.g. ./run-tests.sh -m "not slow".
set -euo pipefail
cd "$(dirname "$0")"
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
python3 -m ruff check .
python3 -m pytest -q "$@"
