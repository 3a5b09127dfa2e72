"""The checkpoint in flight, as the driver drives it: launched with the step after it, taken when the
writer answers, published (CheckpointWriter.publish) only once metrics.jsonl holds its step's row on disk.
actors/checkpoint_writer.py says what the writer and Adam do meanwhile."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatrain.actors.checkpoint_writer import CheckpointWriter, Written
from megatrain.ipc.protocol import StoreSpec
from megatrain.launch.control.crew import Crew
from megatrain.launch.control.placement import Demand
from megatrain.launch.control.runners import Pending
from megatrain.launch.run.checkpointing import Checkpointer

WRITER = "checkpoint-writer"


class Saves:
    """`recorded()`: the last step whose metrics row is written; `sync()`: puts metrics.jsonl on disk."""

    def __init__(
        self,
        crew: Crew,
        checkpointer: Checkpointer,
        meta: dict[str, Any],
        timeout_s: float,
        recorded: Callable[[], int],
        sync: Callable[[], None],
    ):
        self.crew, self.checkpointer, self.meta, self.timeout_s = crew, checkpointer, meta, timeout_s
        self.recorded, self.sync = recorded, sync
        self.pending: Pending[Written] | None = None  # the checkpoint being written
        self.staged: Written | None = None  # written but not yet published

    def ensure_writer(self, threads: int, spec: StoreSpec) -> None:
        """The writer, started on demand (a graceful stop in a run that asked for no periodic saves)."""
        if WRITER not in self.crew.actors:
            self.crew.spawn(WRITER, CheckpointWriter, (threads,), Demand(0.0, 0.0))
            self.crew.call_one(WRITER, CheckpointWriter.attach, spec)

    def start(self, step: int, epoch: int, seed: int) -> None:
        """Launch the write of the state after `step`. The writer takes each piece once Adam's update of
        `step` is in; the next step's call tells Adam to hold each piece's next update until it is taken."""
        self.wait()  # one write at a time
        meta = {
            **self.meta,
            "data": {"position": step, "seed": seed, "epoch": epoch},
            "lr_schedule_position": step,
            "rng": "none: a step draws nothing at random; batch t is a function of (data, data.seed, t)",
        }
        self.checkpointer.started(step)
        self.pending = self.crew.call(WRITER, CheckpointWriter.write, step, str(self.checkpointer.root.resolve()), meta)

    def writing(self) -> dict[str, Pending]:
        """The write in flight, for a wait that watches it without waiting for it."""
        return {WRITER: self.pending} if self.pending is not None else {}

    def taken(self, res: dict) -> None:
        """Take the writer's answer if a wait got it, and publish it when its step's row is on disk."""
        if WRITER in res:
            self.pending, self.staged = None, res[WRITER]
            self.publish_ready()

    def publish_ready(self) -> None:
        """Publish the written checkpoint once metrics.jsonl holds its step's row, on disk: a run resumed
        from it keeps the rows up to its step, so none may be missing."""
        step = self.checkpointer.writing
        if self.staged is None or step is None or self.recorded() < step:
            return
        self.sync()
        res, self.staged = self.staged, None
        self.crew.call_one(WRITER, CheckpointWriter.publish, step)
        self.checkpointer.finished(dataclasses.asdict(res))

    def wait(self) -> None:
        """Wait for the checkpoint being written, if any, and publish it (every caller has recorded the
        metrics of its step)."""
        if self.pending is not None:
            step = self.checkpointer.writing
            self.taken(self.crew.gather(self.writing(), self.timeout_s, f"the checkpoint after step {step}"))
