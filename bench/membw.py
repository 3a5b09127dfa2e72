"""Host memory bandwidth with the Adam updater's threads: the wall a CPU AdamW runs into.

  python bench/membw.py [--gib 4] [--threads 16]

Streams over fp32 arrays much larger than the caches with Numba prange loops, the Adam updater's way:
a STREAM triad (2 reads, 1 write) and the AdamW pattern itself (reads p, m, v and a bf16 gradient,
writes p, m, v and a bf16 copy: 28 bytes per parameter). Prints GB/s and, for the AdamW pattern, the
Gparam/s a kernel bound by memory alone would reach; bench/run.py's Adam column is measured against it.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

ADAM_BYTES = 28  # per parameter: p, m, v read and written (24), a bf16 gradient read (2), a bf16 copy written (2)


@numba.njit(parallel=True, cache=True)
def _triad(a, b, c, s):  # pragma: no cover - compiled
    for i in numba.prange(a.size):
        a[i] = b[i] + s * c[i]


@numba.njit(parallel=True, cache=True)
def _adam_pattern(p, m, v, g, out):  # pragma: no cover - compiled
    for i in numba.prange(p.size):
        gi = np.float32(g[i]) * np.float32(1e-3)
        m[i] = m[i] * np.float32(0.9) + gi
        v[i] = v[i] * np.float32(0.95) + gi * gi
        p[i] = p[i] - m[i] / (np.sqrt(v[i]) + np.float32(1e-8))
        out[i] = np.uint16(p[i] > 0)


def best_of(fn, repeats: int = 5) -> float:
    fn()  # compile, fault in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0, help="size of each fp32 array")
    p.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    args = p.parse_args()
    numba.set_num_threads(args.threads)
    n = int(args.gib * 2**30) // 4
    a, b, c = (np.ones(n, np.float32) for _ in range(3))
    t = best_of(lambda: _triad(a, b, c, np.float32(0.5)))
    print(f"triad: {3 * 4 * n / t / 1e9:.1f} GB/s ({args.threads} threads, {args.gib:g} GiB arrays)")
    g, out = np.ones(n, np.uint16), np.zeros(n, np.uint16)
    t = best_of(lambda: _adam_pattern(a, b, c, g, out))
    print(f"AdamW pattern: {ADAM_BYTES * n / t / 1e9:.1f} GB/s, {n / t / 1e9:.2f} Gparam/s at most "
          f"({ADAM_BYTES} bytes per parameter)")


if __name__ == "__main__":
    main()
