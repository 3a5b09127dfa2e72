"""One memory plan of a run, made once by the driver before anything is spawned: the staging mode, the
host terms against the node the store will live on, the room left there for pinned activation
checkpoints, and the GPU part. The store owner is sent it and only re-checks its admission on its own
node (ipc/shared/shm.py check_space); `megatrain-launch plan` renders it (launch/config/memplan.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatrain.config.engine import EngineConfig, fixed_sizes
from megatrain.errors import ConfigError
from megatrain.memory.gpu import GpuPart, gpu_part
from megatrain.memory.host import (
    PAGE_TABLES,
    PINNED,
    REAPER,
    STAGING_BYTES,
    StoreShape,
    host_terms,
    page_table_bytes,
    pinned_checkpoint_bytes,
    process_terms,
    resolve_spares,
    spare_elems,
    spare_part_bytes,
    spare_room,
)
from megatrain.memory.machine import Machine
from megatrain.model.arch import Arch
from megatrain.roster import OWNER, Roster, build_roster, slabs_refusal

# Pinned checkpoints are optional host memory (the GPU takes those the host does not): they stop this far
# below the run's limit, so that the processes' transient allocations and the planning error (about half a
# GiB at the 7B's 512K run) do not take the node over Ray's kill line.
CHECKPOINT_HEADROOM_FRACTION = 0.02


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """What of a run's config the memory plan reads (launch/config/memplan.py run_shape builds it)."""

    engine: EngineConfig  # resolved for the device; its sizes may still be `auto`
    executors: int
    batch: int  # sequences per step on each executor
    seq: int
    clip: bool
    staging: str  # ipc.staging as asked: auto, slabs or resident
    weight_slabs: int
    grad_slabs: int
    slab_params: int
    num_packers: int
    num_accumulators: int
    saves_checkpoints: bool
    launcher: bool  # the launcher is a process of its own on the node (not the in-process runner)
    private_ray: bool  # the run starts its own Ray instance on the node
    header_bytes: int  # each segment's header (ipc/shared/shm.py)
    ctl_fixed: int  # the control segment's fixed part (ipc/protocol/ctl.py)
    ctl_piece_bytes: int  # and its bytes per piece
    hosts: int = 1  # the hosts of the run: the plan is each one's (megatrain/memory/hosts.py)
    spare_slots: int | str = 0  # ipc.spare_slots as asked

    @property
    def cuda(self) -> bool:
        return self.engine.device == "cuda"


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """A run's memory: where its store lives and how, its host terms on `machine`, and its GPU part."""

    machine: Machine
    shape: RunShape
    staging_mode: str  # resolved: slabs or resident
    roster: Roster  # the run's actors in that mode (megatrain/roster.py): the processes the host part counts
    store_parts: dict[str, int]  # each segment's data bytes (StoreShape.part_bytes)
    host: dict[str, int]  # host terms (shm:, executor:, process:, node:)
    pinned_room: int | None  # host RAM the executors' pinned checkpoints may take in all; None: not bounded
    gpu: GpuPart
    engine: EngineConfig  # with the sizes the GPU part chose
    spares: int = 0  # ipc.spare_slots resolved: the units with a spare slot (the store owner settles its own)
    spares_why: str = ""

    @property
    def shm_part(self) -> int:
        """What of the host lives in shared memory."""
        return sum(v for k, v in self.host.items() if k.startswith("shm:"))

    @property
    def reserve(self) -> int:
        """What the run's processes take beside the store: kept free when the owner admits the store."""
        return sum(v for k, v in self.host.items() if k.startswith("process:"))

    @property
    def pinned(self) -> int:
        return self.host.get(PINNED, 0)

    def run_pss(self) -> int:
        """What the run's own processes take (their PSS, the store counted once): the host part less what the
        node spends on it besides ("node:" terms), which a run's own PSS report leaves out."""
        return sum(v for k, v in self.host.items() if not k.startswith("node:"))

    def least_host(self) -> int:
        """The host need without the pinned activation checkpoints (the GPU takes those the host does not)."""
        return sum(self.host.values()) - self.pinned

    def host_fits(self) -> bool:
        return sum(self.host.values()) <= self.machine.limit and self.shm_part <= self.machine.shm

    @property
    def gpu_limit(self) -> int | None:
        """What the run may take of the GPU: its free memory, capped at the budget."""
        known = [v for v in (self.gpu.free, self.gpu.budget) if v is not None]
        return min(known) if known else None

    def gpu_fits(self) -> bool:
        limit = self.gpu_limit
        return not self.gpu.error and (limit is None or sum(self.gpu.terms.values()) <= limit)

    def fits(self) -> bool:
        return self.host_fits() and self.gpu_fits()


def staging_by_rule(staging: str, cuda: bool, clip: bool, executors: int = 1, hosts: int = 1) -> str | None:
    """ipc.staging resolved where the memory does not decide it; None where it does: 'auto' on CUDA without
    clipping, one executor (resident if it fits, else slabs). With clipping resident: its copy also holds the
    gradients, so it is the smallest store there is (slabs would need a gradient plane). On the CPU device
    slabs: no DMA to feed. Several executors, or several hosts, take the resident copy whatever the device
    (megatrain/roster.py slabs_refusal says why)."""
    refusal = slabs_refusal(executors, hosts)
    if refusal:
        if staging == "slabs":
            raise ConfigError(f"ipc.staging: {refusal}")
        return "resident"
    if staging != "auto":
        return staging
    if not cuda:
        return "slabs"
    return "resident" if clip else None


def decide_staging(shape: RunShape, fits_resident: bool) -> str:
    """ipc.staging resolved: by the rule, or where the memory decides, resident where its plan fits the node
    (`fits_resident`), else slabs."""
    mode = staging_by_rule(shape.staging, shape.cuda, shape.clip, shape.executors, shape.hosts)
    if mode is not None:
        return mode
    return "resident" if fits_resident else "slabs"


def staging_mode(arch: Arch, shape: RunShape, machine: Machine) -> str:
    """The staging mode a run takes on `machine` (the node its store will live on), decided from the plan of
    its host memory before any actor is spawned: the roles that run follow from it."""
    return _host_plan(arch, shape, machine, None).staging_mode


def plan_memory(arch: Arch, shape: RunShape, machine: Machine, gpu_free: int | None = None) -> MemoryPlan:
    """The run's memory plan on `machine` with `gpu_free` bytes free on each GPU (None: the CPU device, or a
    GPU not measured here). The staging mode and the room for pinned checkpoints are decided on the host
    part without those checkpoints; the GPU part is sized within that room; the host part then counts the
    checkpoints the chosen sizes pin."""
    plain = _host_plan(arch, shape, machine, None)
    room = plain.pinned_room
    each = None if room is None else room // shape.executors  # each executor pins its own checkpoints
    resident = plain.staging_mode == "resident"
    gpu = gpu_part(
        arch, shape.engine, shape.batch, shape.seq, shape.executors, gpu_free, shape.clip, each, shape.hosts, resident
    )
    return _with_spares(
        arch, dataclasses.replace(_host_plan(arch, shape, machine, gpu, plain.staging_mode), pinned_room=room)
    )


def _with_spares(arch: Arch, plan: MemoryPlan) -> MemoryPlan:
    """The plan with ipc.spare_slots resolved in the host memory it leaves (megatrain/memory/host.py
    resolve_spares), their segments among its terms. The store owner decides the same way on its node, against
    the memory there once the engine's sizes are known."""
    shape, machine, engine = plan.shape, plan.machine, plan.engine
    held = engine.gpu_optimizer if isinstance(engine.gpu_optimizer, int) else 0
    room = spare_room(machine.shm, machine.limit, machine.total, plan.shm_part, sum(plan.host.values()))
    staging_bytes = STAGING_BYTES.get(engine.compute_dtype, 2)
    try:
        count, why = resolve_spares(
            shape.spare_slots,
            arch.layout,
            held,
            resident=plan.staging_mode == "resident",
            clip=shape.clip,
            hosts=shape.hosts,
            room=room,
            staging_bytes=staging_bytes,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if count:
        parts = spare_part_bytes(
            spare_elems(arch.layout, count, shape.hosts), spare_elems(arch.layout, count), staging_bytes
        )
        host = dict(plan.host)
        host.update({f"shm: {k}": v + shape.header_bytes for k, v in parts.items()})
        host[PAGE_TABLES] += page_table_bytes(parts)
        plan = dataclasses.replace(plan, store_parts={**plan.store_parts, **parts}, host=host)
    return dataclasses.replace(plan, spares=count, spares_why=why)


def _host_plan(
    arch: Arch, shape: RunShape, machine: Machine, gpu: GpuPart | None, mode: str | None = None
) -> MemoryPlan:
    """The plan's host part with the GPU part `gpu` (None: the fixed sizes, no checkpoints pinned); `mode`:
    the staging mode decided (None: decided here, on the plan without pinned checkpoints)."""
    engine = fixed_sizes(shape.engine) if gpu is None else _applied(shape.engine, gpu.sizes)
    if gpu is not None:  # engine.gpu_optimizer as the GPU part resolved it (0 on the CPU device)
        engine = dataclasses.replace(engine, gpu_optimizer=gpu.gpu_units)
    if mode is None:
        resident = _plan(arch, shape, machine, engine, "resident", 0, gpu)
        mode = decide_staging(shape, resident.host_fits())
    pinned = 0 if gpu is None else shape.executors * _pinned(arch, engine, shape)
    plan = _plan(arch, shape, machine, engine, mode, pinned, gpu)
    if gpu is not None or not shape.cuda:
        return plan
    headroom = int(machine.limit * CHECKPOINT_HEADROOM_FRACTION)
    return dataclasses.replace(plan, pinned_room=machine.limit - headroom - sum(plan.host.values()))


def _plan(
    arch: Arch,
    shape: RunShape,
    machine: Machine,
    engine: EngineConfig,
    mode: str,
    pinned: int,
    gpu: GpuPart | None,
) -> MemoryPlan:
    store = StoreShape(
        layout=arch.layout,
        staging_mode=mode,
        clip=shape.clip,
        staging_dtype=engine.compute_dtype,
        weight_slabs=shape.weight_slabs,
        grad_slabs=shape.grad_slabs,
        slab_params=shape.slab_params,
        ctl_fixed=shape.ctl_fixed,
        ctl_piece_bytes=shape.ctl_piece_bytes,
        hosts=shape.hosts,
    )
    roster = build_roster(
        executors=shape.executors,
        packers=shape.num_packers,
        accumulators=shape.num_accumulators,
        cuda=shape.cuda,
        clip=shape.clip,
        writer=shape.saves_checkpoints,
        staging=mode,
    )
    parts = store.part_bytes()
    processes = process_terms(_processes(roster), shape.cuda, shape.launcher, shape.launcher and shape.private_ray)
    return MemoryPlan(
        machine=machine,
        shape=shape,
        staging_mode=mode,
        roster=roster,
        store_parts=parts,
        host=host_terms(parts, shape.header_bytes, pinned, processes),
        pinned_room=None,
        gpu=gpu or GpuPart(sizes=None, why=""),
        engine=engine,
    )


def _processes(roster: Roster) -> list[str]:
    """The run's processes that take host memory: the roles started with the run, and beside the store owner
    its reaper (a helper process, no actor: ipc/shared/reaper.py)."""
    names = [r.name for r in roster.at_launch]
    return [p for name in names for p in ((name, REAPER) if name == OWNER else (name,))]


def _pinned(arch: Arch, engine: EngineConfig, shape: RunShape) -> int:
    return pinned_checkpoint_bytes(arch.layout.num_layers, arch.hidden_size, engine, shape.batch, shape.seq)


def _applied(engine: EngineConfig, sizes: Any) -> EngineConfig:
    return dataclasses.replace(engine, **dataclasses.asdict(sizes))
