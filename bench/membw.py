"""Host memory bandwidth with the Adam updater's threads: the wall a CPU AdamW runs into.

  python bench/membw.py [--gib 2] [--threads 16]

Streams over fp32 arrays much larger than the caches with Numba prange loops, the Adam updater's way:
a STREAM triad (a = b + s*c) and the product's own fused AdamW kernel (megatrain/host/adamw.py) in the form it
runs with clipping and a resident copy (reads p, m, v and the bf16 gradient from the copy, writes p, m, v
and the new bf16 weights over the gradient: 28 bytes per parameter). Prints the triad's GB/s, counted
STREAM's way (12 bytes per element) and as moved (16: the write's read for ownership), and AdamW's
Gparam/s and GB/s: bench/run.py's Adam column (its rate inside a step) is read against these.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatrain.host.adamw import OptimConfig, adamw_update  # noqa: E402

ADAM_BYTES = 28  # per parameter: p, m, v read and written (24), a bf16 gradient read and its bf16 weight written


@numba.njit(parallel=True, cache=True)
def _triad(a, b, c, s):  # pragma: no cover - compiled
    for i in numba.prange(a.size):
        a[i] = b[i] + s * c[i]


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
    p.add_argument("--gib", type=float, default=2.0, help="size of each fp32 array")
    p.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    args = p.parse_args()
    numba.set_num_threads(args.threads)
    n = int(args.gib * 2**30) // 4
    a, b, c = (np.ones(n, np.float32) for _ in range(3))
    t = best_of(lambda: _triad(a, b, c, np.float32(0.5)))
    print(
        f"triad: {12 * n / t / 1e9:.1f} GB/s counted, {16 * n / t / 1e9:.1f} GB/s moved "
        f"({args.threads} threads, {args.gib:g} GiB arrays)"
    )
    bits = np.full(n, 0x3C00, np.uint16)  # bf16 gradients of 2**-7
    cfg = OptimConfig()
    t = best_of(lambda: adamw_update(a, bits, b, c, step=1, lr=1e-9, cfg=cfg, weight_decay=0.0, bf16_out=bits))
    print(
        f"AdamW (the product's kernel, bf16 gradient in the copy): {n / t / 1e9:.2f} Gparam/s, "
        f"{ADAM_BYTES * n / t / 1e9:.1f} GB/s at {ADAM_BYTES} bytes per parameter"
    )


if __name__ == "__main__":
    main()
