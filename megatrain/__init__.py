"""MegaTrain: full-precision training of large causal LMs on one GPU.

All persistent state (fp32 master weights, fp32 Adam moments) lives in POSIX shared memory on the
host; the GPU executor streams layers through. See README.md for the process architecture.
"""

from collections.abc import Callable

__version__ = "0.1.0"

_writer: Callable[[str], None] | None = None  # a progress bar's writer while one is up (launch/report/progress.py)


def log(msg: str) -> None:
    """One console line of the run (driver and data preparation alike)."""
    if _writer is not None:
        _writer(f"[megatrain] {msg}")
    else:
        print(f"[megatrain] {msg}", flush=True)


def set_log_writer(writer: Callable[[str], None] | None) -> None:
    """Route log lines through `writer` (a progress bar's), or back to print with None."""
    global _writer
    _writer = writer
