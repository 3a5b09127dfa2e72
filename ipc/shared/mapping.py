"""One contiguous mapping over several shared-memory files: a segment's shards.

Why shards: the kernel fills a tmpfs file's pages under that file's own lock, so first touching one large
file tops out at about 4 GiB/s however many threads fault it in, where 16 files touched by 16 threads
went about 13 GiB/s (16-core host of an H200, Linux 6.18). Every page of the store is first touched
once per run (the kernel zeroes it), so a 7.6B model's 99 GiB store costs ~8 s of that instead of ~25 s.
The shards are mapped back to back into one reserved address range, so a plane is still one array and
nothing else in the store changes; /proc/PID/smaps names each shard's file, so the per-run accounting
by name prefix still holds.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

from megatrain.host.hostmem import libc

SHARD_BYTES = 1 << 30  # a segment gets one shard per GiB, up to MAX_SHARDS
MAX_SHARDS = 16  # the first-touch rate stopped growing at about one file per core
ALIGN = 1 << 21  # shard boundaries on 2 MiB: page-aligned for MAP_FIXED on any page size in use

_MAP_FIXED, _MAP_NORESERVE, _PROT_NONE = 0x10, 0x4000, 0  # Linux; not all in every mmap module
_MAP_FAILED = ctypes.c_void_p(-1).value


def shard_sizes(total: int, shard_bytes: int | None = None) -> list[int]:
    """Bytes of each shard of a `total`-byte segment (header included): one per shard_bytes (default
    SHARD_BYTES), at most MAX_SHARDS, boundaries on ALIGN; a small segment is one file."""
    per = shard_bytes or SHARD_BYTES
    count = max(1, min(MAX_SHARDS, _ceil(total, per)))
    return split(total, _ceil(_ceil(total, count), ALIGN) * ALIGN)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def split(total: int, first: int) -> list[int]:
    """Shards of `first` bytes each (the last one the rest): an attacher reads the layout off the first
    shard's file size, so it never depends on this module's constants matching the creator's."""
    if first <= 0 or first >= total:
        return [total]
    return [first] * (total // first) + ([total % first] if total % first else [])


def shard_names(name: str, count: int) -> list[str]:
    """The first shard keeps the segment's name (it holds the header); the others add .1, .2, ..."""
    return [name] + [f"{name}.{k}" for k in range(1, count)]


def map_shards(fds: list[int], sizes: list[int]) -> ctypes.Array:
    """Map the files (each from its offset 0, `sizes` bytes) back to back, read-write and shared, into one
    address range; returns a char array over all of it (a buffer numpy and torch view without copying).
    The range is unmapped once nothing refers to the array any more (a view of it keeps it)."""
    lib, total = libc(), sum(sizes)
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    base = lib.mmap(None, total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if base in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"cannot reserve {total} bytes of address space")
    try:
        at = base
        for fd, size in zip(fds, sizes):
            got = lib.mmap(at, size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
            if got != at:
                raise OSError(ctypes.get_errno(), f"cannot map a shard of {size} bytes")
            at += size
    except BaseException:
        lib.munmap(base, total)
        raise
    buf = (ctypes.c_char * total).from_address(base)
    # Not at interpreter exit: the exit unmaps it anyway, and an exit handler may still read the store.
    weakref.finalize(buf, lib.munmap, base, total).atexit = False
    return buf
