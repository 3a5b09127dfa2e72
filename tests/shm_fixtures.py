"""Helpers shared by the shared-memory tests (test_shm.py, test_store.py, test_segments.py, test_status.py)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatrain.config.ipc import IpcConfig
from megatrain.ipc.protocol import PLANES, StoreSpec
from megatrain.ipc.shared import shm
from megatrain.ipc.shared.shm import HEADER_BYTES, LAYOUT_VERSION, Header

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


def child_env() -> dict:
    """This environment, with the repository importable (a child's `-c` code imports tests' helpers)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


# A child's code that makes a run's segments and a semaphore as its owner and exits (its pid printed first).
DEAD_OWNER = textwrap.dedent("""
    import os, struct, sys
    import posix_ipc
    from megatrain.ipc.shared.shm import CTL_PIDS_OFFSET, HEADER_BYTES, Header, Segment, seg_name, sem_name
    rid = sys.argv[1]
    ctl = Segment.create(seg_name(rid, "ctl"), 4096, Header(bytes(range(16)), rid))
    ctl.mm[HEADER_BYTES + CTL_PIDS_OFFSET: HEADER_BYTES + CTL_PIDS_OFFSET + 8] = struct.pack("<q", os.getpid())
    Segment.create(seg_name(rid, "params"), 8192, Header(bytes(range(16)), rid))
    posix_ipc.Semaphore(sem_name(rid, "wfree0"), posix_ipc.O_CREX, mode=0o600, initial_value=1)
    print(os.getpid(), flush=True)
""")


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def header(rid: str, version: int = LAYOUT_VERSION, pid: int = 0, ticks: int = 0) -> bytes:
    raw = bytearray(Header(HASH, rid, pid, ticks, 4096).pack())
    raw[8:12] = struct.pack("<I", version)  # after the magic: the layout version
    return bytes(raw)


def put(shm_dir: Path, name: str, raw: bytes) -> Path:
    """A file in a temporary shm dir holding `raw` where a segment's header goes."""
    path = shm_dir / name
    path.write_bytes(raw + bytes(HEADER_BYTES + 4096 - len(raw)))
    os.chmod(path, 0o600)
    return path
