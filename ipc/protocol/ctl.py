"""The control segment's layout (byte offsets after the segment header): the abort reason, the role table and
the run's description. Kept free of torch and numba, so `megatrain-launch status` reads a run's ctl segment
without the training stack's imports."""

from __future__ import annotations

from megatrain.ipc.shm import CTL_PIDS_OFFSET, MAX_PIDS

REASON_BYTES = 1024
ROLE_BYTES = 128  # per role: heartbeat, progress, calls in flight, waits in flight, what it waits on
ROLE_TABLE_OFFSET = CTL_PIDS_OFFSET + 8 * MAX_PIDS + REASON_BYTES
# About the run, as JSON (role names by slot, pieces, model, output directory, steps): what
# `megatrain-launch status` needs to read a run from its control segment alone, without its StoreSpec.
ABOUT_OFFSET, ABOUT_BYTES = ROLE_TABLE_OFFSET + ROLE_BYTES * MAX_PIDS, 4096
CTL_FIXED = ABOUT_OFFSET + ABOUT_BYTES

# Role table row (float64/int64 words, then bytes): what the stall monitor reads.
BEAT, PROGRESS, CALLS, WAITS, WAIT_SINCE = range(5)  # words 0-4
WHAT_OFFSET, WHAT_BYTES = 48, ROLE_BYTES - 48
