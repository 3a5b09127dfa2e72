"""When the driver writes checkpoints (train.save_every, train.save_every_minutes, and after the last
step), and the bookkeeping around each: the writer actor does the writing, the driver prunes and logs."""

from __future__ import annotations

import time
from pathlib import Path

from megatrain.launch.driver_config import TrainConfig

from megatrain import checkpoint as ckpt
from megatrain import log


class Checkpointer:
    def __init__(self, cfg: TrainConfig, root: Path, steps: int):
        self.cfg, self.root, self.steps = cfg, root, steps
        self.enabled = cfg.saves_checkpoints
        self.since = time.monotonic()
        self.written: int | None = None  # the step of the newest complete checkpoint of this run
        self.writing: int | None = None  # the step of the one being written
        self.history: list[dict] = []  # what each write reported (path, bytes, seconds, ...)

    def due(self, step: int) -> bool:
        """Whether to write one after `step` optimizer steps."""
        if not self.enabled or step in (self.written, self.writing):
            return False
        every, minutes = self.cfg.save_every, self.cfg.save_every_minutes
        return (step == self.steps or bool(every and step % every == 0)
                or bool(minutes and time.monotonic() - self.since >= 60 * minutes))

    def started(self, step: int) -> None:
        self.since, self.writing = time.monotonic(), step

    def finished(self, res: dict) -> None:
        """A write is complete (renamed into place, `latest` updated): prune the older ones and log it."""
        step, self.writing = self.writing, None
        self.written = step
        self.history.append({"step": step, **res})
        gone = ckpt.prune(self.root, self.cfg.keep_last)
        log(f"checkpoint after step {step}: {res['path']}, {res['bytes'] / 1e9:.2f} GB in {res['seconds']:.1f} s "
            f"({res['bytes'] / 1e9 / max(res['seconds'], 1e-9):.2f} GB/s"
            + ("" if res.get("direct_io", True) else ", buffered: the filesystem refused O_DIRECT") + ")"
            + (f"; removed {', '.join(gone)}" if gone else ""))
