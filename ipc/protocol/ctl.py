"""The control segment's layout, the one both its writers (ipc/protocol/store.py) and its reader without a
StoreSpec (`megatrain-launch status`, ipc/status.py) go through. Byte offsets are into the data area
(after the segment header):

  flags         8 int64 words: the abort flag (ABORTED), what raised it (ABORT_ORIGIN, errors.Origin) and
                when (ABORT_AT, ns since the epoch); Adam's verdict on the last step's gradient (its norm
                and clip scale), which the executor's update of the units the GPU holds waits for
  pids          MAX_PIDS int64 worker pids, at CTL_PIDS_OFFSET (fixed in ipc/shared/shm.py: the reaper reads them)
  reason        the abort reason, NUL-padded UTF-8
  role table    one ROLE_BYTES row per worker slot: heartbeat, progress, calls and waits in flight, when the
                wait began (float64/int64 words), then what it waits on (NUL-padded UTF-8)
  about         the run's description as JSON (role names by slot, pieces, model, output directory, steps)
  per piece     version counters (int64), squared gradient norms (float64), saved steps (int64), and a
                word per unit (the array is sized by the pieces, which are at least as many): which of its
                slots holds a unit's state, 0 its tile or 1 its spare slot (ipc.spare_slots)

Kept free of torch and numba, so `status` reads a run's ctl segment without the training stack's imports.
"""

from __future__ import annotations

import json

import numpy as np

from megatrain.ipc.shared.shm import CTL_PIDS_OFFSET, MAX_PIDS

FLAG_WORDS = 8
ABORTED, ABORT_ORIGIN, ABORT_AT = 0, 1, 2  # flag words: the abort, its origin, its time
# Flag words of Adam's verdict on a step's gradient (store.py publish_verdict): the steps judged (published
# last, with a fence), then the global norm and the clip scale as float64 bits.
VERDICT_STEPS, VERDICT_NORM, VERDICT_SCALE = 3, 4, 5
REASON_OFFSET, REASON_BYTES = CTL_PIDS_OFFSET + 8 * MAX_PIDS, 1024
ROLE_BYTES = 128  # per role: heartbeat, progress, calls in flight, waits in flight, what it waits on
ROLE_TABLE_OFFSET = REASON_OFFSET + REASON_BYTES
# About the run, as JSON: what `megatrain-launch status` needs to read a run from its control segment alone.
ABOUT_OFFSET, ABOUT_BYTES = ROLE_TABLE_OFFSET + ROLE_BYTES * MAX_PIDS, 4096
CTL_FIXED = ABOUT_OFFSET + ABOUT_BYTES
PIECE_BYTES = 32  # per piece: version, squared gradient norm, saved step, and a unit's bank

# Role table row (float64/int64 words, then bytes): what the stall monitor reads.
BEAT, PROGRESS, CALLS, WAITS, WAIT_SINCE = range(5)  # words 0-4
WHAT_OFFSET, WHAT_BYTES = 48, ROLE_BYTES - 48


def ctl_bytes(pieces: int) -> int:
    """The data area of a control segment for a store of `pieces` pieces."""
    return CTL_FIXED + pieces * PIECE_BYTES


def text(raw: np.ndarray) -> str:
    """A NUL-padded UTF-8 field as text."""
    return bytes(raw).rstrip(b"\0").decode(errors="replace")


def write_text(field: np.ndarray, value: str | bytes) -> None:
    """Write a NUL-padded UTF-8 field, cut to leave at least one NUL."""
    raw = (value.encode() if isinstance(value, str) else value)[: len(field) - 1]
    field[:] = 0
    field[: len(raw)] = np.frombuffer(raw, np.uint8)


class CtlView:
    """Numpy views of a control segment's fields over `buf` (a live mapping, or the bytes `status` read),
    whose data area starts at `offset`. `pieces` sizes the per-piece arrays (0: not viewed)."""

    def __init__(self, buf: object, pieces: int, offset: int):
        def at(dtype: type, count: int, where: int) -> np.ndarray:
            return np.frombuffer(buf, dtype, count, offset + where)

        self.flags = at(np.int64, FLAG_WORDS, 0)
        self.pids = at(np.int64, MAX_PIDS, CTL_PIDS_OFFSET)
        self.reason = at(np.uint8, REASON_BYTES, REASON_OFFSET)
        self.role_words = at(np.float64, MAX_PIDS * ROLE_BYTES // 8, ROLE_TABLE_OFFSET).reshape(MAX_PIDS, -1)
        self.role_bytes = at(np.uint8, MAX_PIDS * ROLE_BYTES, ROLE_TABLE_OFFSET).reshape(MAX_PIDS, -1)
        self.about = at(np.uint8, ABOUT_BYTES, ABOUT_OFFSET)
        self.versions = at(np.int64, pieces, CTL_FIXED)
        self.sqnorms = at(np.float64, pieces, CTL_FIXED + 8 * pieces)
        # Per piece, the step of the last checkpoint that has it on disk: Adam's update after that step
        # waits for it while that checkpoint is being written (see actors/checkpoint_writer.py).
        self.saved = at(np.int64, pieces, CTL_FIXED + 16 * pieces)
        # Per unit (its index), the bank its state lives in: 0 its own tile, 1 its spare slot. Adam turns it
        # when a speculative update becomes the state, before it publishes the unit's versions.
        self.banks = at(np.int64, pieces, CTL_FIXED + 24 * pieces)

    @property
    def aborted(self) -> bool:
        return bool(self.flags[ABORTED])

    def abort_reason(self) -> str:
        return text(self.reason)

    def waiting_on(self, slot: int) -> str:
        return text(self.role_bytes[slot, WHAT_OFFSET : WHAT_OFFSET + WHAT_BYTES])

    def read_about(self) -> dict:
        """The run's description; {} where none was written or it does not parse."""
        blob = bytes(self.about).rstrip(b"\0")
        try:
            return json.loads(blob) if blob else {}
        except ValueError:
            return {}
