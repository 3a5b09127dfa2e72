"""POSIX shared-memory segments with a checked header, free-space checks, and the sweeper.

Every segment of a run is named /megatrain-<run_id>-<part> (its shards after the first: <part>.1, ...;
ipc/shared/mapping.py; semaphores /megatrain-<run_id>-sem-...),
created with mode 0600 by the one owner, and starts with a 4 KiB header (magic, layout version,
layout hash, run id, owner pid and start time) that every attacher checks. Only the owner unlinks;
attachers never register anything with Python's resource tracker (posix_ipc does not).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import struct
import time
from dataclasses import dataclass

import posix_ipc
import psutil

from megatrain.errors import LayoutMismatch, ResourceError
from megatrain.ipc.procs import live, start_ticks
from megatrain.ipc.shared.mapping import map_shards, shard_names, shard_sizes, split
from megatrain.memory.machine import (  # re-exported: the readings check_space compares with
    RAY_DEFAULT_THRESHOLD as RAY_DEFAULT_THRESHOLD,
)
from megatrain.memory.machine import RAY_THRESHOLD_ENV as RAY_THRESHOLD_ENV
from megatrain.memory.machine import mem_available_bytes as mem_available_bytes
from megatrain.memory.machine import mem_total_bytes as mem_total_bytes
from megatrain.memory.machine import monitor_room as monitor_room
from megatrain.memory.machine import shm_free_bytes as shm_free_bytes

MAGIC = b"MEGATRN\x01"
LAYOUT_VERSION = 2  # 2: the control segment's 'about' area
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sII16s32sQQQ")
CTL_PIDS_OFFSET = 64  # bytes into the ctl data area: worker pids (int64), fixed so the reaper finds them
MAX_PIDS = 64
PREFIX = "megatrain-"
_RUN_ID = re.compile(r"^[a-z0-9]{1,32}$")
_ENTRY = re.compile(r"^(?:sem\.)?megatrain-([a-z0-9]{1,32})-(.+)$")


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ValueError(f"run id '{run_id}' must be 1-32 lowercase letters and digits")
    return run_id


def host_run_id(run_id: str, host: int) -> str:
    """The run id of host `host`'s store: host 0's is the run's, host h's the run's with `h<h>` after it, so that
    hosts simulated on one machine (or sharing its /dev/shm) never meet."""
    if host == 0:
        return run_id
    named = f"{run_id}h{host}"
    if not _RUN_ID.match(named):
        raise ValueError(f"run id '{run_id}' is too long for host {host}'s store ('{named}': at most 32 characters)")
    return named


def run_of_host(store_run_id: str, host: int) -> str:
    """The run's id, from the run id of host `host`'s store (host_run_id's inverse)."""
    mark = f"h{host}"
    if host == 0:
        return store_run_id
    if not store_run_id.endswith(mark):
        raise ValueError(f"'{store_run_id}' is not the run id of host {host}'s store")
    return store_run_id[: -len(mark)]


def seg_name(run_id: str, part: str) -> str:
    return f"/{PREFIX}{run_id}-{part}"


def sem_name(run_id: str, what: str) -> str:
    return f"/{PREFIX}{run_id}-sem-{what}"


@dataclass(frozen=True)
class Header:
    layout_hash: bytes
    run_id: str
    owner_pid: int = 0
    owner_ticks: int = 0
    data_bytes: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC,
            LAYOUT_VERSION,
            HEADER_BYTES,
            self.layout_hash,
            self.run_id.encode(),
            self.owner_pid,
            self.owner_ticks,
            self.data_bytes,
        )

    @classmethod
    def unpack(cls, raw: bytes) -> tuple[bytes, int, Header]:
        magic, version, _, lhash, rid, pid, ticks, nbytes = _HEADER.unpack_from(raw)
        return magic, version, cls(lhash, rid.rstrip(b"\0").decode(errors="replace"), pid, ticks, nbytes)


class Segment:
    """One mapped segment over its shards (ipc/shared/mapping.py); `mm` (a char array) covers header + data,
    data starts at HEADER_BYTES."""

    def __init__(self, name: str, mm: ctypes.Array, header: Header, owner: bool, shards: int):
        self.name, self.mm, self.header, self.owner = name, mm, header, owner
        self.shards = shard_names(name, shards)

    @property
    def data_bytes(self) -> int:
        return self.header.data_bytes

    @classmethod
    def create(cls, name: str, data_bytes: int, header: Header) -> Segment:
        hdr = Header(header.layout_hash, header.run_id, os.getpid(), start_ticks(os.getpid()), data_bytes)
        sizes = shard_sizes(HEADER_BYTES + data_bytes)
        made: list[posix_ipc.SharedMemory] = []
        try:
            for shard, size in zip(shard_names(name, len(sizes)), sizes):
                made.append(posix_ipc.SharedMemory(shard, posix_ipc.O_CREX, mode=0o600, size=size))
            mm = map_shards([m.fd for m in made], sizes)
        except BaseException:
            for m in made:
                m.unlink()
            raise
        finally:
            for m in made:
                m.close_fd()
        mm[: _HEADER.size] = hdr.pack()
        return cls(name, mm, hdr, owner=True, shards=len(sizes))

    @classmethod
    def attach(cls, name: str, layout_hash: bytes, run_id: str) -> Segment:
        read = _read_shard(name, _HEADER.size)
        if read is None:
            raise LayoutMismatch(f"shared-memory segment {name} does not exist (owner gone?)")
        raw, first = read
        if len(raw) < _HEADER.size:
            raise LayoutMismatch(f"cannot attach {name}: {first} bytes, shorter than its header")
        magic, version, hdr = Header.unpack(raw)
        problem = (
            "bad magic"
            if magic != MAGIC
            else f"layout version {version}, expected {LAYOUT_VERSION}"
            if version != LAYOUT_VERSION
            else f"run id '{hdr.run_id}', expected '{run_id}'"
            if hdr.run_id != run_id
            else "layout hash differs (the model or store plan changed)"
            if hdr.layout_hash != layout_hash
            else None
        )
        if problem:
            raise LayoutMismatch(f"cannot attach {name}: {problem}")
        sizes = split(HEADER_BYTES + hdr.data_bytes, first)
        return cls(name, _map_existing(name, sizes), hdr, owner=False, shards=len(sizes))

    def unlink(self) -> None:
        if not self.owner:  # an attacher unlinking would pull the store from under a live run
            raise RuntimeError(
                f"segment {self.name}: only its owner (pid {self.header.owner_pid}) unlinks it; "
                f"this process (pid {os.getpid()}) attached to it"
            )
        for shard in self.shards:
            try:
                posix_ipc.unlink_shared_memory(shard)
            except posix_ipc.ExistentialError:
                pass

    def close(self) -> None:
        """Let go of the mapping: it is unmapped now, or once the last array viewing it is gone."""
        self.mm = None


def _read_shard(name: str, size: int) -> tuple[bytes, int] | None:
    """(the first `size` bytes, the file's size) of shared-memory file `name`, read-only; None if it does
    not exist."""
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        return None
    try:
        if shm.size < size:
            return b"", shm.size
        with mmap.mmap(shm.fd, size, prot=mmap.PROT_READ) as mm:
            return mm[:size], shm.size
    finally:
        shm.close_fd()


def _map_existing(name: str, sizes: list[int]) -> ctypes.Array:
    """Map the shards of an existing segment; a missing or short shard is a LayoutMismatch."""
    opened: list[posix_ipc.SharedMemory] = []
    try:
        for shard, size in zip(shard_names(name, len(sizes)), sizes):
            try:
                opened.append(posix_ipc.SharedMemory(shard))
            except posix_ipc.ExistentialError:
                raise LayoutMismatch(f"cannot attach {name}: its shard {shard} does not exist") from None
            if opened[-1].size < size:
                raise LayoutMismatch(f"cannot attach {name}: shard {shard} holds {opened[-1].size} < {size} bytes")
        return map_shards([s.fd for s in opened], sizes)
    finally:
        for s in opened:
            s.close_fd()


def ray_memory_threshold() -> float | None:
    """The fraction of the node's RAM in use above which Ray's memory monitor kills its workers, where this
    process is a Ray worker (the raylet's setting reaches its workers' environment, with the raylet's pid);
    None elsewhere (a driver, the in-process runner), whose processes the monitor does not kill."""
    if "RAY_RAYLET_PID" not in os.environ:
        return None
    try:
        return float(os.environ.get(RAY_THRESHOLD_ENV, RAY_DEFAULT_THRESHOLD))
    except ValueError:
        return RAY_DEFAULT_THRESHOLD


def pss_split(pid: int, prefix: str) -> tuple[int, int]:
    """Proportional set size of a process (shared pages split among the processes that map them, so the
    sum over a run's processes counts the shared-memory store once), and the part of it outside the
    mappings whose path contains `prefix` (a run's segments): what the process costs beyond the store.
    (0, 0) if the process is gone. One read of its mappings."""
    try:
        maps = psutil.Process(pid).memory_maps(grouped=True)
    except (psutil.Error, OSError, ValueError):
        return 0, 0
    total = sum(m.pss for m in maps)
    return total, total - sum(m.pss for m in maps if prefix in m.path)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def space_now(shm_dir: str = "/dev/shm") -> tuple[int, int]:
    """(bytes free in shm_dir, MemAvailable): what check_space compares with, taken now."""
    return shm_free_bytes(shm_dir), mem_available_bytes()


def check_space(
    parts: dict[str, int],
    shm_dir: str = "/dev/shm",
    ram_only: dict[str, int] | None = None,
    space: tuple[int, int] | None = None,
) -> None:
    """Refuse, with the numbers, a store that would not fit in /dev/shm or in available RAM.

    `ram_only` is host memory the run will take outside shared memory (the executor's pinned
    activation checkpoints): it counts against RAM, not against /dev/shm. `space`: space_now() as it
    was before this run's store existed (the store owner re-checks its plan once the sizes are known)."""
    need = sum(parts.values()) + len(parts) * HEADER_BYTES
    detail = ", ".join(f"{k} {gib(v)}" for k, v in parts.items())
    free, avail = space or space_now(shm_dir)
    if need > free:
        raise ResourceError(
            f"the host store needs {gib(need)} in {shm_dir} ({detail}) but only {gib(free)} "
            f"is free; free space there, enlarge it, or train a smaller model"
        )
    ram_only = {k: v for k, v in (ram_only or {}).items() if v}
    need += sum(ram_only.values())
    detail += "".join(f", {k} {gib(v)}" for k, v in ram_only.items())
    if avail and need > avail:
        raise ResourceError(
            f"the host store needs {gib(need)} of RAM ({detail}) but only {gib(avail)} is "
            f"available (MemAvailable){_lighter(parts, ram_only)}"
        )
    threshold = ray_memory_threshold()
    room = monitor_room(avail, threshold, mem_total_bytes())
    if avail and room is not None and need > room:
        raise ResourceError(
            f"the host store needs {gib(need)} of RAM ({detail}); {gib(avail)} is available, but "
            f"Ray's memory monitor kills this node's workers above {threshold:.0%} of its RAM "
            f"({RAY_THRESHOLD_ENV}), which leaves {gib(max(room, 0))} for the run"
            f"{_lighter(parts, ram_only)}"
        )


def _lighter(parts: dict[str, int], ram_only: dict[str, int]) -> str:
    """The settings that shrink the largest optional parts, for the refusal message."""
    tips = []
    if parts.get("grads"):
        tips.append(f"optim.max_grad_norm=0 (no clipping: no fp32 gradient plane, -{gib(parts['grads'])})")
    if parts.get("resident"):
        tips.append(f"ipc.staging=slabs (no resident copy, -{gib(parts['resident'])})")
    if any(v for k, v in ram_only.items() if "checkpoints" in k):
        tips.append(
            "a larger engine.checkpoint_interval or engine.offload_checkpoints=false (fewer pinned "
            "activation checkpoints)"
        )
    return "; settings that need less: " + "; ".join(tips) if tips else ""


def run_entries(shm_dir: str = "/dev/shm") -> dict[str, list[str]]:
    """Entries in shm_dir per run id (file names as listed, semaphores with their 'sem.' prefix)."""
    runs: dict[str, list[str]] = {}
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return runs
    for name in names:
        m = _ENTRY.match(name)
        if m:
            runs.setdefault(m.group(1), []).append(name)
    return runs


def read_ctl(run_id: str, start: int, size: int, shm_dir: str = "/dev/shm") -> bytes | None:
    """Bytes [start, start + size) of the run's control segment, read-only, from its file in shm_dir (POSIX
    shared memory is a file there); None if it is missing, unreadable or shorter."""
    try:
        with open(os.path.join(shm_dir, f"{PREFIX}{run_id}-ctl"), "rb") as f:
            raw = os.pread(f.fileno(), size, start)
    except OSError:
        return None
    return raw if len(raw) == size else None


def read_header(run_id: str, shm_dir: str = "/dev/shm") -> tuple[bytes, int, Header] | None:
    """(magic, layout version, header) of the run's control segment; None if it has no header to read."""
    raw = read_ctl(run_id, 0, _HEADER.size, shm_dir)
    return Header.unpack(raw) if raw is not None else None


def read_owner(run_id: str, shm_dir: str = "/dev/shm") -> tuple[int, int] | None:
    """(pid, start ticks) of the run's owner from its control segment, None if unreadable."""
    got = read_header(run_id, shm_dir)
    return (got[2].owner_pid, got[2].owner_ticks) if got is not None and got[0] == MAGIC else None


def read_worker_pids(run_id: str, shm_dir: str = "/dev/shm") -> list[int]:
    """Worker pids recorded in the run's ctl segment (empty if it is gone)."""
    raw = read_ctl(run_id, HEADER_BYTES + CTL_PIDS_OFFSET, 8 * MAX_PIDS, shm_dir)
    return [p for p in struct.unpack(f"<{MAX_PIDS}q", raw) if p > 0] if raw is not None else []


def remove_run(run_id: str, entries: list[str], shm_dir: str = "/dev/shm", wait_s: float = 10.0) -> list[str]:
    """Remove a dead run: its segments and semaphores first (the memory goes as soon as the last mapping
    does), then what the CUDA driver left for its workers, once they are gone too (up to wait_s)."""
    workers = read_worker_pids(run_id, shm_dir)  # before ctl goes
    return unlink_entries(entries, shm_dir) + remove_cuda_ipc_files(workers, shm_dir, wait_s)


def remove_cuda_ipc_files(pids: list[int], shm_dir: str = "/dev/shm", wait_s: float = 10.0) -> list[str]:
    """Remove the cuda.shm.<dev>.<pid hex>.<n> files that the CUDA driver makes for interprocess events.

    The driver deletes them when the creating process destroys its events; a process killed with
    SIGKILL leaves them behind. Only files of pids that are (or, within wait_s, become) dead go.
    """
    deadline = time.monotonic() + wait_s
    pids = [p for p in pids if p != os.getpid()]
    while any(live(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    dead = {f"{p:x}" for p in pids if not live(p)}
    removed = []
    for name in os.listdir(shm_dir):
        parts = name.split(".")
        if name.startswith("cuda.shm.") and len(parts) >= 4 and parts[3] in dead:
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def unlink_entries(entries: list[str], shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink entries of shm_dir (segments, and semaphores by their 'sem.' file: what shm_unlink and
    sem_unlink remove); the ones that went. One already gone, or not this user's to remove, is skipped."""
    removed = []
    for name in entries:
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except (FileNotFoundError, PermissionError):
            pass
    return removed
