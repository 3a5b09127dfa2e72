"""MegaTrain: full-precision training of large causal LMs on one GPU.

All persistent state (fp32 master weights, fp32 Adam moments) lives in POSIX shared memory on the
host; the GPU executor streams layers through. See README.md for the process architecture.
"""

__version__ = "0.1.0"


def log(msg: str) -> None:
    """One console line of the run (driver and data preparation alike)."""
    print(f"[megatrain] {msg}", flush=True)
