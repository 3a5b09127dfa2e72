"""The actors' start-up: Ray starts and every actor spawns while the launcher reads the run's inputs; the worker
processes start (imports, Numba, a CUDA context) while the store owner makes and fills the store; the engine's
`auto` sizes are chosen from the executor's free GPU memory meanwhile; the owner settles the store with them;
then every worker attaches. Each phase is timed (Phases)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from megatrain import autosize, gpubudget, log
from megatrain.actors.adam_updater import AdamUpdater
from megatrain.actors.base import Role
from megatrain.actors.checkpoint_writer import CheckpointWriter
from megatrain.actors.gpu_executor import GpuExecutor, executor_name
from megatrain.actors.grad_accumulator import GradAccumulator
from megatrain.actors.packer import Packer
from megatrain.actors.store_owner import FillReport, StoreOwner
from megatrain.engine import EngineConfig, resolve_engine
from megatrain.errors import ConfigError, ResourceError
from megatrain.ipc.protocol import StoreSpec
from megatrain.ipc.protocol.reduce import reduction_bytes
from megatrain.launch.config.tree import Config
from megatrain.launch.control.crew import OWNER, Crew
from megatrain.launch.control.placement import (
    Demand,
    batch_split_problem,
    bundle,
    demands,
    describe_need,
    expect_packers,
    per_executor,
    resolve_executors,
)
from megatrain.launch.control.runners import Pending
from megatrain.launch.report.describe import describe_run
from megatrain.launch.run.stopping import Background
from megatrain.model import ModelSpec, pretrained_config


class Phases:
    """Seconds per start-up phase, in order, from the launch (logged before step 1)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self, since: float | None = None) -> None:
        """From now, or from `since` (time.time()): the launcher's process start, so that its own Python start
        and imports count as the first phase, as a user waiting at the prompt sees them."""
        now, wall = time.monotonic(), time.time()
        self.launched_wall = since if since is not None else wall
        self.launched = now - (wall - self.launched_wall)
        self.seconds: dict[str, float] = {}
        if since is not None:
            self.close("launcher started (Python, imports)")

    def close(self, name: str) -> None:
        """Close a phase: the time since launch not yet given to an earlier one."""
        self.seconds[name] = time.monotonic() - self.launched - sum(self.seconds.values())

    def describe(self, marks: dict[str, dict]) -> None:
        log(
            f"start-up {sum(self.seconds.values()):.1f} s: "
            + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
        )
        log(
            "start-up by process (s after launch): "
            + "; ".join(
                f"{name}: " + ", ".join(f"{k} {t - self.launched_wall:.1f}" for k, t in m.items() if t)
                for name, m in marks.items()
            )
        )


@dataclass(frozen=True)
class Spawned:
    cuda: bool  # the run uses a GPU
    executors: int  # actors.num_gpus, resolved
    engine: EngineConfig  # resolved for the device, `auto` sizes still open
    demands: dict[str, Demand]  # each actor's resources, as placed


def spawn_actors(crew: Crew, cfg: Config, reading: Background, phases: Phases) -> Spawned:
    """Start Ray, place and spawn every actor from the config alone (they import torch and the modeling code,
    make a CUDA context), while `reading` reads the run's inputs (launch/run/inputs.py)."""
    crew.runner.connect(bundle(demands(cfg.actors, cuda=False))["CPU"])
    phases.close("Ray" + ("" if reading.here else " (the inputs are read meanwhile)"))
    if reading.failed():  # refused while Ray started: no actor is spawned for it
        reading.result()
    cuda = cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and crew.runner.has_gpu())
    n = resolve_executors(cfg.actors, cuda, crew.runner.gpus() if cuda else 0)
    split = batch_split_problem(cfg.data.batch_size, n)  # auto: known only now
    if split:
        raise ConfigError(f"data.batch_size {split}")
    engine = resolve_engine(cfg.engine, cuda)
    writer = cfg.train.saves_checkpoints
    dem = demands(cfg.actors, cuda, clip=cfg.optim.clips, writer=writer, staging=cfg.ipc.staging, executors=n)
    crew.runner.place(bundle(dem), describe_need(dem))
    family = pretrained_config(cfg.model)[0]
    # Beside the inputs means a Ray run with no checkpoint to resume (driver.py): a fresh init, unless pretrained.
    ahead = not reading.here and not cfg.model.pretrained
    crew.spawn(OWNER, StoreOwner, (OWNER, family if ahead else ""), dem[OWNER])
    spawn_workers(crew, cfg, family, engine, dem, expect_packers(cfg.ipc.staging, cuda, n), writer)
    phases.close("placement, actors spawned")
    return Spawned(cuda, n, engine, dem)


def packer_plan(num_packers: int) -> list[tuple[str, type, tuple]]:
    return [(f"packer-{i}", Packer, (i,)) for i in range(num_packers)]


def spawn_workers(
    crew: Crew, cfg: Config, family: str, engine: EngineConfig, dem: dict[str, Demand], packers: bool, writer: bool
) -> None:
    ranks = [n for n in dem if n.startswith("gpu-executor")]  # as demands() made them, executor 0 first
    plan: list[tuple[str, type, tuple]] = [
        (executor_name(r), GpuExecutor, (engine, family, r)) for r in range(len(ranks))
    ]
    accumulators = [n for n in dem if n.startswith("grad-accumulator-")]  # as demands() expects them
    plan += [(name, GradAccumulator, (i,)) for i, name in enumerate(accumulators)]
    plan += [("adam-updater", AdamUpdater, (cfg.optim,))]
    if writer:
        plan += [("checkpoint-writer", CheckpointWriter, (cfg.actors.writer_threads,))]
    if packers:
        plan += packer_plan(cfg.actors.num_packers)
    for name, cls, args in plan:
        crew.spawn(name, cls, args, dem[name])


def choose_sizes(
    crew: Crew, cfg: Config, model: ModelSpec, engine: EngineConfig, host_room: int | None
) -> EngineConfig:
    """Resolve the engine's `auto` sizes from the GPU memory the executor finds free (autosize.py) and the host
    RAM left beside the store for pinned activation checkpoints (None where the store's node is not this
    machine: the owner checks the host then)."""
    executors = crew.named("gpu-executor")
    batch = per_executor(cfg.data.batch_size, len(executors))  # every executor is sized for the largest share
    free = None
    if engine.device == "cuda":
        found = crew.gather(
            {n: crew.call(n, GpuExecutor.gpu_room) for n in executors}, crew.setup_timeout_s, "free GPU memory"
        )
        # the GPUs may differ: the smallest sizes them all (each capped at engine.gpu_memory_gib less its
        # CUDA context); several executors keep fp32 gradients queued for their reduction beside the
        # activations (ipc/protocol/reduce.py)
        free = min(f if room is None else min(f, room) for f, room in found.values())
        budget_note(engine, found)
        free -= reduction_bytes(model) if len(executors) > 1 else 0
    room = host_room // len(executors) if host_room is not None else None  # each pins its own checkpoints
    sizes, why = autosize.choose(model, engine, batch, cfg.data.seq_len, free, cfg.optim.clips, room)
    engine = autosize.apply(engine, sizes)
    log(f"engine sizes: {sizes} ({why}; the rule for 'auto': megatrain/autosize.py)")
    if free is not None and gpubudget.budget_bytes(engine) is not None:  # the run never plans past its budget
        peak = gpubudget.peak_bytes(model, engine, batch, cfg.data.seq_len, sizes)
        if peak > free:
            raise ResourceError(
                f"{gpubudget.KEY} {engine.gpu_memory_gib} GiB: the plan's GPU peak {gpubudget.gib(peak)} at these "
                f"sizes is more than the {gpubudget.gib(free)} it leaves (megatrain-launch plan CONFIG shows the plan)"
            )
    for n in executors:
        crew.call_one(n, GpuExecutor.warm_up, model, engine, batch, cfg.data.seq_len)
    return engine


def budget_note(engine: EngineConfig, found: dict[str, tuple[int, int | None]]) -> None:
    """Log what engine.gpu_memory_gib leaves each executor, and where the GPU has less free."""
    for name, (free, room) in found.items():
        if room is not None:
            less = f"; the GPU has only {gpubudget.gib(free)} free: planned for that" if free < room else ""
            room_said = f"{gpubudget.gib(room)} beside the CUDA context"
            log(f"{name}: {gpubudget.KEY} {engine.gpu_memory_gib} GiB, {room_said}{less}")


def form_group(crew: Crew, size: int, timeout: float) -> None:
    """The executors' process group (megatrain/collective.py): executor 0 opens the rendezvous, all join
    at once (a group forms only when every member is there)."""
    executors = crew.named("gpu-executor")
    port = crew.call_one(executors[0], GpuExecutor.open_group, size)
    backends = crew.gather(
        {n: crew.call(n, GpuExecutor.join_group, port, size) for n in executors},
        timeout,
        "forming the executors' group",
    )
    log(f"{size} executors: gradients summed through torch.distributed ({backends[executors[0]]}) into executor 0")


def settle_store(
    crew: Crew, creating: Pending[StoreSpec], engine: EngineConfig, timeout: float
) -> tuple[StoreSpec, FillReport]:
    """Wait for the owner's create call, settle the store with the chosen sizes; (spec, how it was filled)."""
    crew.gather({OWNER: creating}, timeout, "store-owner.create")
    spec = crew.call_one(OWNER, StoreOwner.settle, engine)
    log(
        f"weight staging: {spec.staging_mode}; gradients: "
        + (
            "into the resident copy, until the global norm is known (clipping)"
            if spec.grads_in_resident and spec.clip
            else "into the resident copy, updated as they come (no clipping)"
            if spec.grads_in_resident
            else "fp32 plane, global-norm clipping"
            if spec.clip
            else "straight to Adam (no clipping)"
        )
    )
    fill = crew.call_one(OWNER, StoreOwner.fill_report)
    log(
        f"store filled from {fill.source} in {fill.seconds:.1f} s"
        + (
            f" ({fill.bytes / 1e9:.2f} GB read, {fill.bytes / 1e9 / max(fill.seconds, 1e-9):.2f} GB/s)"
            if fill.bytes
            else ""
        )
    )
    return spec, fill


def attach_workers(
    crew: Crew, cfg: Config, spec: StoreSpec, dem: dict[str, Demand], engine: EngineConfig, start: int
) -> None:
    """End the workers the settled store does not need (or start packers it does), attach the others, and
    connect the executor's CUDA IPC events to the processes that drain its gradient slabs."""
    timeout = cfg.train.setup_timeout_s
    packers = crew.named("packer-")
    if spec.resident:  # nothing to pack per step: Adam writes the resident copy
        for name in packers:
            crew.drop(name)
    if not spec.running_accumulators:  # gradients go straight to Adam, or into the resident copy
        for name in crew.named("grad-accumulator-"):
            crew.drop(name)
    elif not packers:
        for name, cls, args in packer_plan(cfg.actors.num_packers):
            crew.spawn(name, cls, args, dem[name])
    crew.gather(
        {n: _attach(crew, n, spec, engine, start) for n in crew.actors if n != OWNER}, timeout, "starting the actors"
    )
    infos = crew.gather({n: crew.call(n, Role.info) for n in crew.actors}, timeout, "starting the actors")
    crew.pids = {n: i.pid for n, i in infos.items()}
    crew.marks = {n: i.marks for n, i in infos.items()}
    crew.runner.pids = crew.pids
    crew.call_one(OWNER, StoreOwner.page_in)  # now, not beside the fill or the pinning (it slows both)
    handles = crew.call_one("gpu-executor", GpuExecutor.event_handles)
    if handles is not None:
        drainers = crew.named("grad-accumulator") if spec.clip else ["adam-updater"]
        crew.gather({n: crew.call(n, Role.open_events, handles) for n in drainers}, 120, "opening CUDA IPC events")


def _attach(crew: Crew, name: str, spec: StoreSpec, engine: EngineConfig, start: int) -> Pending[None]:
    """A worker's attach call: each class's own, with what its role needs besides the spec."""
    cls = crew.actors[name].cls
    if cls is AdamUpdater:
        return crew.call(name, AdamUpdater.attach, spec, start)  # Adam's step count (bias correction) continues
    if cls is GpuExecutor:
        return crew.call(name, GpuExecutor.attach, spec, engine)  # with the sizes chosen since it started
    if cls is CheckpointWriter:
        return crew.call(name, CheckpointWriter.attach, spec)
    if cls is Packer:
        return crew.call(name, Packer.attach, spec)
    if cls is GradAccumulator:
        return crew.call(name, GradAccumulator.attach, spec)
    raise TypeError(f"actor '{name}' ({cls.__name__}) is not a worker that attaches to the store")


def describe(crew: Crew, spec: StoreSpec, engine: EngineConfig, inprocess: bool, phases: Phases) -> None:
    device = crew.call_one("gpu-executor", GpuExecutor.device_name)
    describe_run(spec, device, engine.compute_dtype, crew.pids, list(crew.actors), inprocess)
    phases.describe(crew.marks)
