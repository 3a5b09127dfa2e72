"""Host memory at the page level: libc's mmap/munmap/madvise, and faulting pages in ahead of their use.

A page's first touch is the kernel's work (it zeroes the page, or maps one already in the page cache);
done ahead, in parallel, it leaves the hot path: the store owner pages in Adam's moments while it draws
the weights, and the executor faults in its mapping of the resident copy before cudaHostRegister, which
otherwise takes each page's fault on one thread inside the registration.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable without touching their bytes
MADV_REMOVE = 9  # free a shared mapping's pages and their backing (a tmpfs file's: a hole that reads as zeros)
PIECE_BYTES = 1 << 28  # one madvise call: a stop request waits for at most one per thread
_LIBC: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    """libc with the signatures of the calls used here and in ipc/shared/mapping.py."""
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = lib
    return _LIBC


def populate_range(start: int, nbytes: int) -> bool:
    """Fault in [start, start + nbytes) as a write would, leaving the bytes alone; runs without the GIL.
    False where the kernel cannot (older than 5.14, or a sandbox's): nothing done."""
    lo = start - start % mmap.PAGESIZE
    return libc().madvise(lo, start + nbytes - lo, MADV_POPULATE_WRITE) == 0


def release_range(start: int, nbytes: int) -> int:
    """Give the pages wholly inside [start, start + nbytes) of a shared mapping back to the system, their
    backing included (MADV_REMOVE: a tmpfs file keeps a hole there, which reads as zeros and is paged in again
    by the next write). The partial pages at either end are kept: their other bytes may be another's. The
    bytes given back; 0 where the kernel or the file system cannot (nothing done, the bytes kept)."""
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return 0
    return hi - lo if libc().madvise(lo, hi - lo, MADV_REMOVE) == 0 else 0


def ranges_without(whole: np.ndarray, holes: list[np.ndarray]) -> list[tuple[int, int]]:
    """(address, bytes) stretches of `whole` (a view of a mapping) that leave out the arrays `holes` (views
    inside it)."""
    start, end, out = whole.ctypes.data, whole.ctypes.data + whole.nbytes, []
    for hole in sorted(holes, key=lambda a: a.ctypes.data):
        if hole.ctypes.data > start:
            out.append((start, hole.ctypes.data - start))
        start = max(start, hole.ctypes.data + hole.nbytes)
    return out + ([(start, end - start)] if end > start else [])


def populate(array: np.ndarray) -> bool:
    """populate_range over the memory under `array` (a view of a mapping)."""
    return populate_range(array.ctypes.data, array.nbytes)


def fault_in(ranges: list[tuple[int, int]], threads: int, stop: threading.Event | None = None) -> tuple[int, int]:
    """populate_range over (start, bytes) ranges in PIECE_BYTES pieces on up to `threads` threads, each
    starting in its own stretch (a sharded segment's files are paged in one at a time each: ipc/shared/mapping.py);
    a set `stop` skips the pieces not begun. Returns (pieces done, pieces)."""
    pieces = [(s, min(PIECE_BYTES, lo + n - s)) for lo, n in ranges for s in range(lo, lo + n, PIECE_BYTES)]

    def one(piece: tuple[int, int]) -> bool:
        return not (stop is not None and stop.is_set()) and populate_range(*piece)

    if len(pieces) <= 1 or threads <= 1:
        return sum(map(one, pieces)), len(pieces)
    with ThreadPoolExecutor(min(threads, len(pieces)), thread_name_prefix="fault-in") as pool:
        return sum(pool.map(one, spread(pieces, threads))), len(pieces)


def spread(items: list, threads: int) -> list:
    """`items` reordered so that `threads` workers taking them in order start far apart, each walking its
    own stretch."""
    stretch = -(-len(items) // max(threads, 1))
    return [x for k in range(stretch) for x in items[k::stretch]]
