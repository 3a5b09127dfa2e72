"""The actors' start-up: Ray starts and every actor spawns while the launcher reads the run's inputs; the worker
processes start (imports, Numba, a CUDA context) while the store owner makes and fills the store; the engine's
`auto` sizes are chosen from the executor's free GPU memory meanwhile; the owner settles the store with them;
then every worker attaches. Each phase is timed (Phases)."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from megatrain import log
from megatrain.actors.adam_updater import AdamUpdater
from megatrain.actors.base import Role
from megatrain.actors.checkpoint_writer import CheckpointWriter
from megatrain.actors.executor.gpu_executor import GpuExecutor
from megatrain.actors.grad_accumulator import GradAccumulator
from megatrain.actors.packer import Packer
from megatrain.actors.store_owner import StoreOwner
from megatrain.collective import HOST
from megatrain.config.optim import OptimConfig
from megatrain.errors import ConfigError, ProtocolError, ResourceError
from megatrain.ipc.messages import FillReport, StoreRequest
from megatrain.ipc.protocol import StoreSpec
from megatrain.ipc.shared.shm import host_run_id
from megatrain.launch.config import memplan
from megatrain.launch.config.tree import Config, gpu_budget_without_gpu
from megatrain.launch.control.crew import Crew
from megatrain.launch.control.placement import (
    Demand,
    batch_split_problem,
    bundle,
    check_hosts_run_id,
    demands,
    describe_need,
    local_cpus,
    per_executor,
    resolve_executors,
    resolve_hosts,
    roster_for,
    thread_request,
)
from megatrain.launch.control.runners import Pending
from megatrain.launch.report.describe import describe_run
from megatrain.launch.run.stopping import Background
from megatrain.memory import autosize
from megatrain.memory import budget as gpubudget
from megatrain.memory.gpu import reduction_bytes, resolve_gpu_units
from megatrain.memory.host import spare_refusal
from megatrain.memory.plan import MemoryPlan, staging_by_rule, staging_mode
from megatrain.model.arch import arch_of_spec
from megatrain.model.spec import ModelSpec, pretrained_config
from megatrain.roster import ADAM, EXECUTOR, OWNER, Attach, Kind, RoleSpec, Roster, on_host, split_host
from megatrain.step.engine import EngineConfig, resolve_engine

# Each kind's actor class (megatrain/roster.py says how a role is added).
ACTORS: dict[Kind, type[Role]] = {
    Kind.OWNER: StoreOwner,
    Kind.EXECUTOR: GpuExecutor,
    Kind.ADAM: AdamUpdater,
    Kind.PACKER: Packer,
    Kind.ACCUMULATOR: GradAccumulator,
    Kind.WRITER: CheckpointWriter,
}


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


@dataclass(frozen=True, kw_only=True)
class Spawned:
    cuda: bool  # the run uses a GPU
    executors: int  # actors.num_gpus, resolved: the executors of each host
    hosts: int  # actors.num_hosts, resolved
    engine: EngineConfig  # resolved for the device, `auto` sizes still open
    roster: Roster  # the run's actors, for the staging mode resolved before any worker was spawned


def spawn_actors(crew: Crew, cfg: Config, reading: Background, phases: Phases) -> Spawned:
    """Start Ray, resolve the staging mode, place and spawn every actor of the run's roster (they import torch
    and the modeling code, make a CUDA context), while `reading` reads the run's inputs (launch/prepare/inputs.py).
    Where the staging mode depends on the memory of the store's node, the owner is spawned first and the
    workers once it is decided: the roster has only the workers the run uses."""
    crew.runner.connect(local_cpus(cfg.actors))
    phases.close("Ray" + ("" if reading.here else " (the inputs are read meanwhile)"))
    if reading.failed():  # refused while Ray started: no actor is spawned for it
        reading.result()
    cuda = cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and crew.runner.has_gpu())
    place = "the Ray cluster" if cfg.launch.address or os.environ.get("RAY_ADDRESS") else "this machine"
    problem = None if cuda else gpu_budget_without_gpu(cfg, remote=False, gpus=0, place=place)
    if problem:  # a budget for a GPU the run does not have (a joined cluster's nodes decide): as plan refuses it
        raise ConfigError(problem)
    n = resolve_executors(cfg.actors, cuda, crew.runner.gpus() if cuda else 0)
    hosts = resolve_hosts(cfg.actors, crew.runner.nodes())
    crew.span(hosts)
    if cfg.train.run_id:  # a random one always has room for every host's store name
        check_hosts_run_id(cfg.train.run_id, cfg.actors, hosts)
    split = batch_split_problem(cfg.data.batch_size, n * hosts)  # auto: known only now
    if split:
        raise ConfigError(f"data.batch_size {split}" + (f" (actors.num_hosts {hosts})" if hosts > 1 else ""))
    engine = resolve_engine(cfg.engine, cuda)
    staging = staging_by_rule(cfg.ipc.staging, cuda, cfg.optim.clips, n, hosts)
    # Where the memory decides, the node is placed for the larger roster (slabs: the packers' CPUs too).
    roster = _roster(cfg, cuda, n, staging or "slabs")
    crew.runner.place(bundle(demands(roster)), describe_need(demands(roster)), hosts)
    family = pretrained_config(cfg.model)[0]
    # Beside the inputs means a Ray run with no checkpoint to resume (driver.py): a fresh init, unless pretrained.
    ahead = not reading.here and not cfg.model.pretrained
    for host in range(hosts):
        _spawn(crew, roster[OWNER], (OWNER, family if ahead else ""), host)
    if staging is None:
        roster = _roster(cfg, cuda, n, staging_by_memory(crew, cfg, engine, reading, n))
    crew.staff(roster)
    for host in range(hosts):
        for role in roster.workers:
            _spawn(crew, role, actor_args(role, cfg, family, engine, host * n), host)
    phases.close("placement, actors spawned")
    return Spawned(cuda=cuda, executors=n, hosts=hosts, engine=engine, roster=roster)


def _roster(cfg: Config, cuda: bool, executors: int, staging: str) -> Roster:
    writer = cfg.train.saves_checkpoints
    return roster_for(cfg.actors, cuda=cuda, clip=cfg.optim.clips, writer=writer, staging=staging, executors=executors)


def _spawn(crew: Crew, role: RoleSpec, args: tuple, host: int = 0) -> None:
    crew.spawn(on_host(role.name, host), ACTORS[role.kind], args, Demand(role.cpus, role.gpus))


def actor_args(role: RoleSpec, cfg: Config, family: str, engine: EngineConfig, before: int = 0) -> tuple:
    """A worker's constructor arguments (each class's own). `before`: the executors of the hosts before this
    one's (in one process, as the in-process runner simulates hosts, each executor takes a GPU of its own)."""
    if role.kind is Kind.EXECUTOR:
        return (engine, family, role.index, before + role.index if before else None)
    if role.kind in (Kind.PACKER, Kind.ACCUMULATOR):
        return (role.index,)
    if role.kind is Kind.ADAM:
        return (cfg.optim,)
    if role.kind is Kind.WRITER:
        return (cfg.actors.writer_threads,)
    raise ProtocolError(f"'{role.name}' is not a worker spawned with the run")


def staging_by_memory(crew: Crew, cfg: Config, engine: EngineConfig, reading: Background, executors: int) -> str:
    """ipc.staging 'auto' where the memory decides (CUDA, no clipping), by the memory plan (megatrain/memory/)
    on the memory of the owner's node now. It waits for the inputs (the model's spec)."""
    model = reading.result().model
    machine = crew.call_one(OWNER, StoreOwner.node_machine, cfg.ipc.shm_dir)
    # measured with the launcher and Ray running: their memory is no longer available, not to be kept free
    shape = dataclasses.replace(memplan.run_shape(cfg, engine.device == "cuda", executors), launcher=False)
    mode = staging_mode(arch_of_spec(model), shape, machine)
    log(f"weight staging {mode}: decided on the store's node before the workers start")
    return mode


def choose_sizes(
    crew: Crew, cfg: Config, model: ModelSpec, engine: EngineConfig, host_room: int | None, staging: str
) -> EngineConfig:
    """Resolve the engine's `auto` sizes from the GPU memory the executor finds free (autosize.py) and the host
    RAM left beside the store for pinned activation checkpoints (None where the store's node is not this
    machine: the owner checks the host then), then the units whose optimizer the GPU holds beside them
    (megatrain/memory/gpu.py; `staging`: the store's mode)."""
    executors = crew.of(Kind.EXECUTOR)
    batch = per_executor(cfg.data.batch_size, len(executors))  # every executor is sized for the largest share
    free = None
    if engine.device == "cuda":
        found = crew.gather(
            {n: crew.call(n, GpuExecutor.gpu_room) for n in executors}, crew.setup_timeout_s, "free GPU memory"
        )
        # the GPUs may differ: the smallest sizes them all (each capped at engine.gpu_memory_gib less its
        # CUDA context); several executors keep fp32 gradients queued for their reduction beside the
        # activations (megatrain/memory/gpu.py)
        free = min(f if room is None else min(f, room) for f, room in found.values())
        budget_note(engine, found)
        free -= reduction_bytes(model.layout, crew.hosts) if len(executors) > 1 else 0
    room = host_room // len(executors) if host_room is not None else None  # each pins its own checkpoints
    sizes, why = autosize.choose(model, engine, batch, cfg.data.seq_len, free, cfg.optim.clips, room)
    engine = autosize.apply(engine, sizes)
    log(f"engine sizes: {sizes} ({why}; the rule for 'auto': megatrain/memory/autosize.py)")
    if free is not None and gpubudget.budget_bytes(engine) is not None:  # the run never plans past its budget
        peak = gpubudget.peak_bytes(model, engine, batch, cfg.data.seq_len, sizes)
        if peak > free:
            raise ResourceError(
                f"{gpubudget.KEY} {engine.gpu_memory_gib} GiB: the plan's GPU peak {gpubudget.gib(peak)} at these "
                f"sizes is more than the {gpubudget.gib(free)} it leaves (megatrain-launch plan CONFIG shows the plan)"
            )
    peak = gpubudget.peak_bytes(model, engine, batch, cfg.data.seq_len, sizes) if free is not None else 0
    held, why = resolve_gpu_units(engine, model.layout, free, peak, len(executors), crew.hosts, staging == "resident")
    engine = dataclasses.replace(engine, gpu_optimizer=held)
    log(f"optimizer on the GPU: {why} (engine.gpu_optimizer: {cfg.engine.gpu_optimizer})")
    spares = cfg.ipc.spare_slots  # a count set must leave out the units the GPU now holds (the owner settles it)
    refusal = (
        ""
        if spares == "auto"
        else spare_refusal(int(spares), len(model.layout.units), held, staging == "resident", cfg.optim.clips)
    )
    if refusal:
        raise ConfigError(f"ipc.spare_slots {spares}: {refusal}")
    for n in executors:
        crew.call_one(n, GpuExecutor.warm_up, model=model, cfg=engine, batch=batch, seq=cfg.data.seq_len)
    return engine


def budget_note(engine: EngineConfig, found: dict[str, tuple[int, int | None]]) -> None:
    """Log what engine.gpu_memory_gib leaves each executor, and where the GPU has less free."""
    for name, (free, room) in found.items():
        if room is not None:
            less = f"; the GPU has only {gpubudget.gib(free)} free: planned for that" if free < room else ""
            room_said = f"{gpubudget.gib(room)} beside the CUDA context"
            log(f"{name}: {gpubudget.KEY} {engine.gpu_memory_gib} GiB, {room_said}{less}")


def form_groups(crew: Crew, timeout: float, phases: Phases) -> None:
    """The run's process groups (megatrain/collective.py), one way for every host count: every executor of every
    host joins one rendezvous that host 0's executor 0 opens (the step's statistics over all of them, each host's
    gradient sum into its executor 0, and over several hosts the reduce-scatter among those); over several hosts
    the hosts' Adam updaters then join one of their own (the global norm, the gather of the updated slices). A
    run of one executor forms none: there is nothing to sum."""
    executors, hosts = crew.of(Kind.EXECUTOR), crew.hosts
    if len(executors) == 1:
        return
    address, binds = _meeting_points(crew)
    port = crew.call_one(executors[0], GpuExecutor.open_world, len(executors), address)
    backends = crew.gather(
        {n: crew.call(n, GpuExecutor.join_world, address, port, binds[split_host(n)[1]]) for n in executors},
        timeout,
        "forming the executors' group" + (" over the hosts" if hosts > 1 else ""),
    )
    how = f"through torch.distributed ({backends[executors[0]]})"
    if hosts == 1:
        log(f"{len(executors)} executors: gradients summed {how} into executor 0")
        phases.close(f"the {len(executors)} executors' group formed")
        return
    adams = [on_host(ADAM, h) for h in range(hosts)]
    port = crew.call_one(adams[0], AdamUpdater.open_hosts, address)
    joining = {n: crew.call(n, AdamUpdater.join_hosts, address, port, binds[h]) for h, n in enumerate(adams)}
    crew.gather(joining, timeout, "joining the hosts")
    log(
        f"{hosts} hosts of {len(executors) // hosts} executor(s): gradients summed over all {len(executors)} and "
        f"split among the hosts {how}, the updated slices gathered into every host's copy"
    )
    phases.close(f"the {hosts} hosts' groups formed")


def _meeting_points(crew: Crew) -> tuple[str, list[str | None]]:
    """(where the rendezvous is, each host's address for gloo's connections). One host's executors are all on the
    store's node: they meet on loopback, gloo on its default device. Several hosts meet on host 0's node, each
    host's gloo on its node's address as Ray knows it (megatrain/collective.py gloo_options)."""
    if crew.hosts == 1:
        return HOST, [None]
    nodes: list[str | None] = [crew.runner.host_address(h) for h in range(crew.hosts)]
    return str(nodes[0]), nodes


def create_stores(
    crew: Crew,
    cfg: Config,
    run_id: str,
    spawned: Spawned,
    model: ModelSpec,
    memory: MemoryPlan,
    resume: Path | None,
    about: dict,
) -> dict[str, Pending[StoreSpec]]:
    """Each host's owner's create call, not waited for: it plans with the engine's sizes still `auto`. `resume`:
    the checkpoint the stores are filled from (None: model.pretrained or a fresh init); `about`: what `status`
    says of the run (its output directory, its steps, the first)."""
    crew.serve_owner()
    n, hosts = spawned.executors, spawned.hosts
    return {
        owner: crew.call(
            owner,
            StoreOwner.create,
            StoreRequest(
                run_id=host_run_id(run_id, host),
                model=cfg.model,
                no_decay_1d=cfg.optim.no_decay_1d,
                clip=cfg.optim.clips,
                engine=spawned.engine,
                num_packers=cfg.actors.num_packers,
                num_accumulators=cfg.actors.num_accumulators,
                ipc=cfg.ipc,
                batch_shape=(n * per_executor(cfg.data.batch_size, n * hosts), cfg.data.seq_len),
                resume=str(resume) if resume else None,
                threads=thread_request(cfg.actors),
                about=about,
                executors=n,
                spec=model,
                memory=memory,
                hosts=hosts,
                host=host,
            ),
        )
        for host, owner in enumerate(crew.owners)
    }


def settle_store(
    crew: Crew, creating: dict[str, Pending[StoreSpec]], engine: EngineConfig, timeout: float
) -> tuple[list[StoreSpec], list[FillReport]]:
    """Wait for the owners' create calls, settle each store with the chosen sizes; (each host's spec, how each
    host's store was filled), host 0's first."""
    crew.gather(creating, timeout, f"{OWNER}.create")
    specs = [crew.call_one(owner, StoreOwner.settle, engine) for owner in crew.owners]
    spec = specs[0]
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
    fills = [crew.call_one(owner, StoreOwner.fill_report) for owner in crew.owners]
    fill = fills[0]
    log(
        f"store filled from {fill.source} in {fill.seconds:.1f} s"
        + (
            f" ({fill.bytes / 1e9:.2f} GB read, {fill.bytes / 1e9 / max(fill.seconds, 1e-9):.2f} GB/s)"
            if fill.bytes
            else ""
        )
        + (f" (host 0 of {len(specs)})" if len(specs) > 1 else "")
    )
    return specs, fills


def attach_workers(
    crew: Crew, cfg: Config, specs: list[StoreSpec], roster: Roster, engine: EngineConfig, start: int
) -> None:
    """Attach every host's workers of the roster to that host's store, and connect the executor's CUDA IPC
    events to the processes that drain its gradient slabs."""
    for spec in specs:
        if spec.staging_mode != roster.staging:
            raise ProtocolError(
                f"the store was made for weight staging {spec.staging_mode}, the actors were spawned for "
                f"{roster.staging}"
            )
    timeout = cfg.train.setup_timeout_s
    attaching = {
        on_host(r.name, h): _attach(crew, on_host(r.name, h), r, spec, engine, start, cfg.optim)
        for h, spec in enumerate(specs)
        for r in roster.workers
    }
    crew.gather(attaching, timeout, "starting the actors")
    infos = crew.gather({n: crew.call(n, Role.info) for n in crew.actors}, timeout, "starting the actors")
    crew.note_processes(infos)
    for owner in crew.owners:  # now, not beside the fill or the pinning (it slows both)
        crew.call_one(owner, StoreOwner.page_in)
    for h in range(len(specs)):
        handles = crew.call_one(on_host(EXECUTOR, h), GpuExecutor.event_handles)
        if handles is not None:
            drainers = [on_host(n, h) for n in roster.drainers()]
            crew.gather({n: crew.call(n, Role.open_events, handles) for n in drainers}, 120, "opening CUDA IPC events")


def _attach(
    crew: Crew, name: str, role: RoleSpec, spec: StoreSpec, engine: EngineConfig, start: int, optim: OptimConfig
) -> Pending[None]:
    """Worker `name`'s attach call, with what its roster row says it attaches with besides the spec."""
    if role.attach is Attach.ENGINE:  # with the sizes chosen since it started
        return crew.call(name, GpuExecutor.attach, spec, cfg=engine, optim=optim)
    if role.attach is Attach.START:
        # Adam's step count (bias correction) continues
        return crew.call(name, AdamUpdater.attach, spec, start_step=start)
    if role.attach is Attach.SPEC:
        return crew.call(name, ACTORS[role.kind].attach, spec)  # type: ignore[attr-defined]
    raise ProtocolError(f"actor '{name}' does not attach to the store")


def describe(crew: Crew, spec: StoreSpec, engine: EngineConfig, inprocess: bool, phases: Phases) -> None:
    device = crew.call_one(EXECUTOR, GpuExecutor.device_name)
    describe_run(spec, device, engine.compute_dtype, crew.pids, list(crew.actors), inprocess)
    phases.describe(crew.marks)
