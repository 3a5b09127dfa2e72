#!/usr/bin/env bash
# Set up a fresh machine and train the bundled default (tiny Llama on generated arithmetic).
# Extra arguments are config overrides, e.g. ./run-default.sh train.steps=200 engine.device=cuda
set -euo pipefail
cd "$(dirname "$0")"
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e .
exec megatrain-launch examples/default.yaml "$@"
