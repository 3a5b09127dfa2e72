#!/usr/bin/env bash
# Set up a fresh machine and train the bundled default (tiny Llama on generated arithmetic).
# Extra arguments are config overrides, e.g. ./run-default.sh train.steps=200 engine.device=cuda
set -euo pipefail
# The command a stopped run prints to resume it: this script, as typed here (launch/report/rerun.py).
export MEGATRAIN_RERUN="$0"
export MEGATRAIN_RERUN_FROM="$PWD"
cd "$(dirname "$0")"
source ./bootstrap.sh
megatrain_env
# exec keeps this shell's process, whose start is the set-up's: the launcher's start-up clock begins here.
export MEGATRAIN_EXEC_AT="$(date +%s.%N)"
exec "$PY" -m megatrain.launch.cli examples/default.yaml "$@"
