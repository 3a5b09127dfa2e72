#!/usr/bin/env bash
# Set up a fresh machine and train the bundled default (tiny Llama on generated arithmetic).
# Extra arguments are config overrides, e.g. ./run-default.sh train.steps=200 engine.device=cuda
set -euo pipefail
cd "$(dirname "$0")"
source ./bootstrap.sh
megatrain_env
exec "$PY" -m megatrain.launch.cli examples/default.yaml "$@"
