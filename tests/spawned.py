"""Children for tests that spawn processes: this module imports nothing heavy, since each child imports it."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def killed_rank(rank: int, out: str) -> None:
    """Rank 1 is killed as the OOM killer would; the others write a result."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    Path(out, f"rank{rank}.json").write_text('{"status": "ok"}')
