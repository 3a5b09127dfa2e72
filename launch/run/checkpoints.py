"""The run's checkpoints as the driver drives them. When one is due (train.save_every,
train.save_every_minutes, and after the last step) and the bookkeeping around each, pruning and the log
line (Checkpointer); and the one in flight (Saves): launched with the step after it, taken when the writer
answers, published (CheckpointWriter.publish) only once metrics.jsonl holds its step's row on disk.
actors/checkpoint_writer.py says what the writer and Adam do meanwhile."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatrain import log
from megatrain.actors.checkpoint_writer import CheckpointWriter
from megatrain.actors.executor.gpu_executor import GpuExecutor
from megatrain.actors.store_owner import StoreOwner
from megatrain.formats import checkpoint as ckpt
from megatrain.formats.export import export
from megatrain.ipc.messages import WriteRequest, Written
from megatrain.ipc.protocol import StoreSpec
from megatrain.launch.config.train import TrainConfig
from megatrain.launch.control.crew import Crew
from megatrain.launch.control.placement import Demand
from megatrain.launch.control.runners import Pending
from megatrain.model.spec import ModelSpec
from megatrain.roster import WRITER, Kind, on_host


def clear_torn(root: Path, whose: str) -> list[str]:
    """Remove what unfinished checkpoint writes left in `root`, saying so: a *.tmp-* entry (step-N.tmp-hosts
    holding every host's part, or an earlier version's one-host step-N.tmp-PID), which nothing reads but which
    takes a checkpoint's size on the disk. The run's start removes what a killed run left (the output
    directory's lock says no other run writes there), its end what its own aborted write left. `whose`: whose
    write it was, as the line says."""
    gone = sorted(ckpt.remove_torn(root))
    if gone:
        log(
            f"removed {', '.join(gone)} from {root}: {whose} checkpoint write that did not finish "
            "(no complete checkpoint was touched)"
        )
    return gone


class Checkpointer:
    """When a checkpoint is due, and what a finished one leaves: the older ones pruned, a log line, its record."""

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
        return (
            step == self.steps
            or bool(every and step % every == 0)
            or bool(minutes and time.monotonic() - self.since >= 60 * minutes)
        )

    def started(self, step: int) -> None:
        self.since, self.writing = time.monotonic(), step

    def finished(self, res: dict) -> None:
        """A write is complete (renamed into place, `latest` updated): prune the older ones and log it."""
        step, self.writing = self.writing, None
        self.written = step
        self.history.append({"step": step, **res})
        gone = ckpt.prune(self.root, self.cfg.keep_last)
        log(
            f"checkpoint after step {step}: {res['path']}, {res['bytes'] / 1e9:.2f} GB in {res['seconds']:.1f} s "
            f"({res['bytes'] / 1e9 / max(res['seconds'], 1e-9):.2f} GB/s"
            + ("" if res.get("direct_io", True) else ", buffered: the filesystem refused O_DIRECT")
            + ")"
            + (f"; removed {', '.join(gone)}" if gone else "")
        )


class Saves:
    """`recorded()`: the last step whose metrics row is written; `sync()`: puts metrics.jsonl on disk. Every
    host's writer writes its part of each checkpoint (one host: the one part), and host 0's makes it whole."""

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
        self.pending: dict[str, Pending[Written]] = {}  # each host's writer's part being written
        self.parts: dict[str, Written] = {}  # the parts written so far
        self.staged: Written | None = None  # written whole (every part) but not yet published

    @property
    def writers(self) -> list[str]:
        """Every host's writer, host 0's first."""
        return [on_host(WRITER, h) for h in range(self.crew.hosts)]

    def ensure_writer(self, threads: int, specs: list[StoreSpec]) -> None:
        """The writers, started on demand (a graceful stop in a run that asked for no periodic saves): each
        host's attached to its store (`specs`, host by host)."""
        for name, spec in zip(self.writers, specs, strict=True):
            if name not in self.crew.actors:
                self.crew.spawn(name, CheckpointWriter, (threads,), Demand(0.0, 0.0))
                self.crew.call_one(name, CheckpointWriter.attach, spec)

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
        flush_gpu_state(self.crew, step, self.timeout_s)
        request = WriteRequest(step=step, root=str(self.checkpointer.root.resolve()), meta=meta)
        self.pending = {n: self.crew.call(n, CheckpointWriter.write, request) for n in self.writers}

    def writing(self) -> dict[str, Pending]:
        """The write in flight, for a wait that watches it without waiting for it."""
        return dict(self.pending)

    def taken(self, res: dict) -> None:
        """Take the writers' answers a wait got, and publish the checkpoint when every part is written and its
        step's row is on disk."""
        for name in [n for n in self.pending if n in res]:
            self.pending.pop(name)
            self.parts[name] = res[name]
        if self.parts and not self.pending:
            self.staged, self.parts = _whole([self.parts[n] for n in self.writers]), {}
            self.publish_ready()

    def publish_ready(self) -> None:
        """Publish the written checkpoint once metrics.jsonl holds its step's row, on disk: a run resumed
        from it keeps the rows up to its step, so none may be missing."""
        step = self.checkpointer.writing
        if self.staged is None or step is None or self.recorded() < step:
            return
        self.sync()
        res, self.staged = self.staged, None
        for name in self.writers:  # each host's part
            self.crew.call_one(name, CheckpointWriter.publish, step)
        path = self.crew.call_one(self.writers[0], CheckpointWriter.publish_hosts, step)  # the step's directory
        res = dataclasses.replace(res, path=path)
        self.checkpointer.finished(dataclasses.asdict(res))

    def wait(self) -> None:
        """Wait for the checkpoint being written, if any, and publish it (every caller has recorded the
        metrics of its step)."""
        if self.pending:
            step = self.checkpointer.writing
            self.taken(self.crew.gather(self.writing(), self.timeout_s, f"the checkpoint after step {step}"))


# The final save moves the weights from the stores to the launcher in chunks of this many fp32 values, at most
# CHUNKS_IN_FLIGHT asked at once: through Ray, every chunk is an object of its store, which must never hold more
# than a fraction of its launch.object_store_mb (a unit of a large model is GBs, beyond any object store).
CHUNK_ELEMS = 8 << 20  # 32 MiB
CHUNKS_IN_FLIGHT = 2


def flush_gpu_state(crew: Crew, step: int | None, timeout_s: float) -> None:
    """Every executor writes the state of the units its device holds (engine.gpu_optimizer) back into its
    store: for the checkpoint of the state after `step` steps, or (None) for the final weights."""
    executors = crew.of(Kind.EXECUTOR)
    crew.gather({n: crew.call(n, GpuExecutor.flush, step) for n in executors}, timeout_s, "the GPU's units' state")


def save_final(crew: Crew, model: ModelSpec, directory: Path, run: dict, record: dict, timeout_s: float) -> str:
    """The run's final fp32 weights as an HF directory at `directory`, written here one unit at a time, each
    unit gathered from every host's slice of it (one host: the unit whole from its one store), in chunks: no
    process ever holds more than one unit of the model in fp32."""
    flush_gpu_state(crew, None, timeout_s)
    units = Units(crew, timeout_s)
    return str(export(model, units.take, directory, run=run, record=record))


class Units:
    """Each unit's fp32 master weights whole, from every host's store owner in host order, each owner's slice
    fetched chunk by chunk with CHUNKS_IN_FLIGHT asked ahead."""

    def __init__(self, crew: Crew, timeout_s: float):
        self.crew, self.timeout_s, self.chunk = crew, timeout_s, CHUNK_ELEMS

    def take(self, unit: int) -> torch.Tensor:
        return torch.cat([piece for owner in self.crew.owners for piece in self._slice(owner, unit)])

    def _slice(self, owner: str, unit: int) -> list[torch.Tensor]:
        """The owner's slice of the unit as chunks; a chunk shorter than asked is its end (the chunks asked
        past it come back empty)."""
        pieces: list[torch.Tensor] = []
        asked: deque[Pending[torch.Tensor]] = deque()
        start, ended = 0, False
        while not ended or asked:
            while not ended and len(asked) < CHUNKS_IN_FLIGHT:
                asked.append(self.crew.call(owner, StoreOwner.params_slice, unit, start, self.chunk))
                start += self.chunk
            got = self.crew.gather({owner: asked.popleft()}, self.timeout_s, f"unit {unit}'s weights from {owner}")
            piece = got[owner]
            pieces.append(piece)
            ended = ended or piece.numel() < self.chunk
        return pieces


def _whole(parts: list[Written]) -> Written:
    """Every host's part of a checkpoint as one: the bytes of all, the slowest part's time."""
    return dataclasses.replace(
        parts[0],
        bytes=sum(p.bytes for p in parts),
        seconds=max(p.seconds for p in parts),
        waited_for_adam_s=max(p.waited_for_adam_s for p in parts),
        direct_io=all(p.direct_io for p in parts),
    )
