"""Checkpoints and the version counters: the writer's fence-read-write-publish of each piece, Adam's wait for
it, and the versions of a store restored from a checkpoint.

The checkpoint of step N is the state after Adam's N-th update, which exists piece by piece, never all at
once (actors/checkpoint_writer.py tells the whole story):
  writer: claim(piece)    wait until its version reaches N (acquire), and check it is exactly N;
          (write its params, exp_avg and exp_avg_sq to disk)
          written(piece)  check it is still N (read after the data, between fences), publish saved = N;
  adam:   wait_taken      before its update of step N+1 writes the piece, wait for saved >= N.
So the writer never sees a piece half-updated or one update too far, and Adam follows right behind it.
"""

from __future__ import annotations

import time

from megatrain.errors import ProtocolError
from megatrain.ipc.protocol.plan import Item
from megatrain.ipc.protocol.store import Store


def claim(store: Store, item: Item, step: int) -> float:
    """Writer: wait until the piece holds Adam's update of `step` (and no later one); the seconds waited."""
    t0 = time.perf_counter()
    store.wait_version(item.unit, step, f"Adam's update of unit {item.unit} (step {step}) to checkpoint it", item.piece)
    waited = time.perf_counter() - t0
    _check_version(store, item, step)
    return waited


def written(store: Store, item: Item, step: int) -> None:
    """Writer: the piece's bytes of `step` are read out; Adam may update it again."""
    _check_version(store, item, step)  # Adam must not have touched it while it was being written
    store.publish_saved(item.piece, step)


def wait_taken(store: Store, item: Item, step: int) -> None:
    """Adam, while the checkpoint of the state after `step` is written: before updating the piece again, wait
    for the writer to have it."""
    store.wait_saved(
        item.piece, step, f"the checkpoint writer to take unit {item.unit} (piece {item.piece}) after step {step}"
    )


def restore_versions(store: Store, step: int) -> None:
    """Owner: the planes were read back from the checkpoint of `step`, so every piece holds Adam's `step`
    updates; published after those writes (release), as Adam publishes its own."""
    store.publish_versions(step)


def _check_version(store: Store, item: Item, step: int) -> None:
    have = store.version(item.piece)
    if have != step:
        raise ProtocolError(
            f"checkpoint of step {step}: unit {item.unit} (piece {item.piece}) is at version "
            f"{have}; Adam must hold its next update until the writer has it"
        )
