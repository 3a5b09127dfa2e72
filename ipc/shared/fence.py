"""Explicit memory ordering for the version counters, the one hand-off in the protocol that is not a
semaphore.

Semaphores need nothing more: sem_post and sem_wait are memory-synchronizing functions in POSIX (XBD
4.12), so a slab filled before sem_post is seen whole by whoever returns from sem_wait, on any
architecture. A version counter is a plain int64 in shared memory: Adam writes a piece's params
(and its resident copy), then the counter; a packer or the executor reads the counter, then the params.
x86 keeps stores in order and loads in order, so plain accesses happen to work there; ARM (GH200's
Grace) does not. So the writer issues a full fence before storing the counter (release) and the reader
one after loading it (acquire), as LLVM `fence seq_cst` instructions compiled by Numba (`dmb ish` on
aarch64, `mfence` on x86).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.core.extending import intrinsic


@intrinsic
def _fence(typingctx):  # noqa: ANN001, ARG001 - Numba's intrinsic signature
    def codegen(context, builder, signature, args):  # noqa: ANN001, ARG001
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(cache=True, nogil=True)
def publish(counters: np.ndarray, i: int, value: int) -> None:
    """counters[i] = value, after every earlier write of this thread (release)."""
    _fence()
    counters[i] = value


@numba.njit(cache=True, nogil=True)
def publish_all(counters: np.ndarray, value: int) -> None:
    """counters[:] = value, after every earlier write of this thread (release)."""
    _fence()
    counters[:] = value


@numba.njit(cache=True, nogil=True)
def load(counters: np.ndarray, i: int) -> int:
    """counters[i], ordered after every earlier read of this thread and before every later one: a check made
    after reading the data a counter guards (did it change meanwhile?) as well as before."""
    _fence()
    value = counters[i]
    _fence()
    return value


@numba.njit(cache=True, nogil=True)
def reached(counters: np.ndarray, lo: int, hi: int, value: int) -> bool:
    """min(counters[lo:hi]) >= value, with every later read of this thread after these loads (acquire)."""
    ok = True
    for i in range(lo, hi):
        if counters[i] < value:
            ok = False
            break
    _fence()
    return ok
