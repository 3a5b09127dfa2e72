"""The checkpoint hand-off of ipc/protocol/checkpoints.py on a real store: the writer claims a piece only at
exactly the step's version, refuses one Adam moved while it was written, and releases Adam by publishing
saved; a restored store's versions; and the waits show up in the role table (megatrain-launch status)."""

from __future__ import annotations

import threading
import time

import pytest

from megatrain.errors import ProtocolError, WaitTimeout
from megatrain.ipc.protocol import Store
from megatrain.ipc.protocol.checkpoints import claim, restore_versions, wait_taken, written
from megatrain.ipc.protocol.store import WAITS
from tests.shm_fixtures import ALL_PARTS, make_spec, owned


def wait_for(condition, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


def test_the_writer_claims_at_the_step_and_releases_adam(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)
    with owned(Store.create(spec)) as owner:
        writer = Store.attach(spec, ALL_PARTS, role="checkpoint-writer")
        try:
            item = spec.update_items[0]
            got: list[float] = []
            thread = threading.Thread(target=lambda: got.append(claim(writer, item, 2)))
            thread.start()
            slot = spec.pid_slot("checkpoint-writer")
            wait_for(lambda: writer.role_words[slot, WAITS] > 0)  # waiting, and status says on what
            assert "Adam's update of unit 0 (step 2)" in writer.waiting_on(slot)
            owner.publish_version(item.piece, 2)
            thread.join(10)
            assert got and got[0] > 0 and writer.role_words[slot, WAITS] == 0
            written(writer, item, 2)
            assert writer.saved[item.piece] == 2
            wait_taken(owner, item, 2)  # Adam's next update of the piece may go on at once
        finally:
            writer.close()


def test_a_piece_adam_moved_is_refused(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)
    with owned(Store.create(spec)) as store:
        item = spec.update_items[1]
        store.publish_version(item.piece, 3)
        with pytest.raises(ProtocolError, match=r"checkpoint of step 2: unit 1 .* is at version 3"):
            claim(store, item, 2)  # one update too far
        store.publish_version(item.piece, 2)
        claim(store, item, 2)
        store.publish_version(item.piece, 3)  # Adam did not hold its update while the piece was written
        with pytest.raises(ProtocolError, match="Adam must hold its next update"):
            written(store, item, 2)
        assert store.saved[item.piece] == 0


def test_adam_waits_for_the_writer_to_take_the_piece(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec, wait_timeout_s=0.2)
    want = r"the checkpoint writer to take unit 0 \(piece 0\) after step 4"
    with owned(Store.create(spec)) as store, pytest.raises(WaitTimeout, match=want):
        wait_taken(store, spec.update_items[0], 4)


def test_a_restored_store_has_every_version_at_the_checkpoint_step(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)
    with owned(Store.create(spec)) as store:
        restore_versions(store, 7)
        assert list(store.versions) == [7] * spec.num_pieces
        assert all(store.version(p) == 7 for p in range(spec.num_pieces))
