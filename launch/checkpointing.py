"""When the driver writes checkpoints (train.save_every, train.save_every_minutes, and after the last
step), and the bookkeeping around each: the writer actor does the writing, the driver prunes and logs."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from megatrain.launch.driver_config import TrainConfig

from megatrain import checkpoint as ckpt
from megatrain import log


class Checkpointer:
    def __init__(self, cfg: TrainConfig, root: Path, steps: int):
        self.cfg, self.root, self.steps = cfg, root, steps
        self.enabled = cfg.save_every > 0 or cfg.save_every_minutes > 0
        self.since = time.monotonic()
        self.written: int | None = None

    def due(self, step: int) -> bool:
        """Whether to write one after `step` optimizer steps."""
        if not self.enabled or step == self.written:
            return False
        every, minutes = self.cfg.save_every, self.cfg.save_every_minutes
        return (step == self.steps or bool(every and step % every == 0)
                or bool(minutes and time.monotonic() - self.since >= 60 * minutes))

    def save(self, step: int, write: Callable[[int], dict]) -> None:
        res = write(step)
        self.since, self.written = time.monotonic(), step
        gone = ckpt.prune(self.root, self.cfg.keep_last)
        log(f"checkpoint after step {step}: {res['path']}, {res['bytes'] / 1e9:.2f} GB in {res['seconds']:.1f} s "
            f"({res['bytes'] / 1e9 / max(res['seconds'], 1e-9):.2f} GB/s)"
            + (f"; removed {', '.join(gone)}" if gone else ""))
