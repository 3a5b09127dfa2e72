"""Helpers shared by the shared-memory tests (test_shm.py, test_store.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from megatrain.ipc import shm
from megatrain.ipc.protocol import PLANES, IpcConfig, StoreSpec

SHM = "/dev/shm"
HASH = bytes(range(16))
ALL_PARTS = (*PLANES, "staging")


@contextmanager
def owned(created: Any) -> Iterator[Any]:
    """A Segment or Store this test created: unlinked and closed however the test ends."""
    try:
        yield created
    finally:
        created.unlink()
        created.close()


def leftovers(rid: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if rid in n)


def remove_all(rid: str) -> None:
    shm.unlink_entries(shm.run_entries(SHM).get(rid, []))


def make_spec(
    rid: str,
    model_spec,
    staging: str = "bf16",
    k: int = 2,
    packers: int = 2,
    accs: int = 2,
    staging_mode: str = "slabs",
    **ipc,
) -> StoreSpec:
    ipc = {"weight_slabs": 3, "grad_slabs": 2, **ipc}
    return StoreSpec(rid, model_spec, staging, k, packers, accs, IpcConfig(**ipc), staging_mode)


def release(stores: list, rids: list[str]) -> None:
    """Stores a test made over several run ids (several hosts' on one machine): unlinked and closed, and
    anything else of those runs removed."""
    for st in stores:
        st.unlink()
        st.close()
    for rid in rids:
        remove_all(rid)
