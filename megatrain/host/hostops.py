"""Host-side bulk kernels of the workers (Numba, parallel): memory-bound passes fused into one read."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(parallel=True, cache=True, nogil=True)
def _copy_sqnorm(src, dst):  # pragma: no cover - compiled
    total = 0.0
    for i in numba.prange(src.size):
        x = src[i]
        dst[i] = x
        total += np.float64(x) * np.float64(x)
    return total


def copy_sqnorm(src: np.ndarray, dst: np.ndarray) -> float:
    """dst[:] = src and return sum(src**2) accumulated in fp64, in one parallel pass over src."""
    if src.shape != dst.shape or src.dtype != np.float32 or dst.dtype != np.float32:
        raise ValueError(f"copy_sqnorm: {src.dtype}{src.shape} into {dst.dtype}{dst.shape}")
    return float(_copy_sqnorm(src, dst))


@numba.njit(parallel=True, cache=True, nogil=True)
def _sqnorm(src):  # pragma: no cover - compiled
    total = 0.0
    for i in numba.prange(src.size):
        total += np.float64(src[i]) * np.float64(src[i])
    return total


def sqnorm(src: np.ndarray) -> float:
    """sum(src**2) accumulated in fp64, one parallel pass."""
    return float(_sqnorm(src))


def warm_up() -> None:
    """Compile (or load from Numba's cache) the kernels now, on tiny arrays, so that no step pays for it."""
    a = np.ones(4, np.float32)
    copy_sqnorm(a, np.empty_like(a))
    sqnorm(a)
