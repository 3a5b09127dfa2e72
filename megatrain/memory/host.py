"""Host memory of a run, term by term: the shared-memory store part by part (the very sizes the store owner
creates), the executors' pinned activation checkpoints, the kernel's page tables for the store's mappings,
and the processes themselves (their PSS outside the store, measured on the H200: the executor 1.4 GiB with
its CUDA context, each CPU role about 0.7 GiB). The processes are the run's reserve beside the store: the
plan counts them, and the store owner's admission keeps them free."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from megatrain.config.engine import EngineConfig, fixed_sizes
from megatrain.memory.hosts import host_plane_elems, largest_slice, unit_pieces
from megatrain.model.layout import PLANES, STATE_PLANES, TILE_ALIGN, StoreLayout, round_up
from megatrain.roster import EXECUTOR, Kind, kind_of
from megatrain.step.blocks import blocks

GIB = 2**30
STAGING_BYTES = {"bf16": 2, "fp32": 4}  # a weight's bytes in the staging slabs and the resident copy
PAGE_TABLE_MAPPERS = 3  # processes that map nearly all of the store: the owner, Adam, the executor or workers
REAPER = "reaper"  # the run's reaper: a helper process of the owner, no actor (ipc/shared/reaper.py)
PROCESS_BYTES = {
    EXECUTOR: int(1.4 * GIB),
    "cpu-role": int(0.7 * GIB),
    REAPER: int(0.01 * GIB),
    "driver": int(1.0 * GIB),  # the launcher
    "ray": int(0.8 * GIB),  # a private Ray instance's own processes
}
PINNED = "executor: pinned activation checkpoints"
PAGE_TABLES = "node: page tables of the store's mappings"


@dataclass(frozen=True, kw_only=True)
class StoreShape:
    """What fixes the store's sizes: the model's layout, the staging mode (resolved), clipping, the staging
    dtype, the slabs asked for, and the control segment's layout (ipc/protocol/ctl.py)."""

    layout: StoreLayout
    staging_mode: str  # "slabs" or "resident"
    clip: bool
    staging_dtype: str
    weight_slabs: int
    grad_slabs: int
    slab_params: int  # 0: a decoder layer's
    ctl_fixed: int  # the control segment's bytes besides its pieces'
    ctl_piece_bytes: int  # and per piece
    hosts: int = 1  # the run's hosts: each holds its slice of the fp32 planes (megatrain/memory/hosts.py)
    # ipc.spare_slots resolved: the first `spares` units of the gradient order each have a spare slot (a second
    # tile in every fp32 state plane and in the resident copy) that Adam's speculative update writes into.
    spares: int = 0

    @property
    def resident(self) -> bool:
        return self.staging_mode == "resident"

    @property
    def grads_in_resident(self) -> bool:
        """With a resident copy each unit's gradient waits in the unit's own tile of it (in the compute dtype):
        no gradient plane, no gradient slabs, no accumulators (ipc/protocol/plan.py StoreSpec says why)."""
        return self.resident

    @property
    def planes(self) -> tuple[str, ...]:
        """fp32 planes: only clipping in slabs mode has a gradient plane (16 B/param); without clipping Adam
        takes the gradient slabs directly; with a resident copy the gradients wait there."""
        return PLANES if self.clip and not self.grads_in_resident else STATE_PLANES

    @property
    def num_weight_slabs(self) -> int:
        return 0 if self.resident else self.weight_slabs

    @property
    def num_grad_slabs(self) -> int:
        return 0 if self.grads_in_resident else self.grad_slabs

    @property
    def staging_bytes(self) -> int:
        """A weight's bytes in the staging slabs and the resident copy."""
        return STAGING_BYTES[self.staging_dtype]

    @property
    def slab_elems(self) -> int:
        layout = self.layout
        layers = [layout.structure_of(u.index).numel for u in layout.units if u.kind == "layer"]
        limit = self.slab_params or max(layers, default=layout.max_unit_numel)
        return round_up(max(min(limit, layout.max_unit_numel), 1), TILE_ALIGN)

    @cached_property
    def piece_spans(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per unit, its pieces as [lo, hi) of its elements: slab-sized ranges of its tile, cut at the hosts'
        slices (megatrain/memory/hosts.py unit_pieces; a unit has at least one)."""
        e, layout = self.slab_elems, self.layout
        return tuple(
            tuple(unit_pieces(layout.structure_of(u.index).numel, u.tile, e, self.hosts)) for u in layout.units
        )

    @property
    def num_pieces(self) -> int:
        return sum(len(spans) for spans in self.piece_spans)

    @property
    def plane_elems(self) -> int:
        """Elements of each fp32 plane on each host of the run (one host: the whole plane)."""
        return host_plane_elems(self.layout, self.hosts)

    @property
    def spare_units(self) -> tuple[int, ...]:
        """The units with a spare slot: the first `spares` of the gradient order (the LM head, then the layers
        from the last), whose gradients land first in the backward, so that their speculative update has the
        rest of the backward to run in."""
        return spare_order(self.layout)[: self.spares]

    @property
    def spare_elems(self) -> int:
        """Elements of each fp32 plane's spare slots on each host: the spare units' slices (one host: tiles), one
        after the other."""
        return spare_elems(self.layout, self.spares, self.hosts)

    @property
    def spare_resident_elems(self) -> int:
        """Elements of the resident copy's spare slots: the spare units' whole tiles (every host's copy holds the
        whole unit, the other hosts' slices gathered into it)."""
        return spare_elems(self.layout, self.spares)

    def part_bytes(self) -> dict[str, int]:
        """Each segment's data bytes (without its header), on each host of the run."""
        plane = self.plane_elems * 4
        staging_bytes = self.staging_bytes
        staging = self.slab_elems * (self.num_weight_slabs * staging_bytes + self.num_grad_slabs * 4)
        staging = max(staging, TILE_ALIGN)  # every run has the segment; with no slabs it is a page
        ctl = self.ctl_fixed + self.num_pieces * self.ctl_piece_bytes
        resident = {"resident": self.layout.total * staging_bytes} if self.resident else {}
        spares = spare_part_bytes(self.spare_elems, self.spare_resident_elems, staging_bytes)
        return {**dict.fromkeys(self.planes, plane), "staging": staging, **resident, **spares, "ctl": ctl}


SPARE_PLANES = "spare-planes"  # the spare slots' fp32 state: params, exp_avg, exp_avg_sq, one after the other
SPARE_RESIDENT = "spare-resident"  # and their compute-dtype copies (the executor pins it, as `resident`)
SPARE_FIXED = 1 << 20  # bytes kept beside the spare slots' own (page tables, the segments' headers)


def spare_part_bytes(elems: int, resident_elems: int, staging_bytes: int) -> dict[str, int]:
    """The spare slots' segments for `elems` elements of each fp32 plane's spare slots and `resident_elems` of the
    resident copy's (none for 0)."""
    if not elems:
        return {}
    return {SPARE_PLANES: 3 * 4 * elems, SPARE_RESIDENT: staging_bytes * resident_elems}


def spare_elems(layout: StoreLayout, spares: int, hosts: int = 1) -> int:
    """Elements of each fp32 plane's spare slots on each of `hosts` hosts (a unit's largest slice each; one host:
    its tile) for the first `spares` units of spare_order; hosts 1 also gives the resident copy's."""
    return sum(largest_slice(layout.units[u].tile, hosts) for u in spare_order(layout)[:spares])


def spare_order(layout: StoreLayout) -> tuple[int, ...]:
    """The units in the order they take spare slots: the gradient order (LM head, last layer first, embedding)."""
    last = len(layout.units) - 1
    return (last, *range(last - 1, 0, -1), 0) if last > 0 else (0,)


def spare_refusal(spares: int, units: int, gpu_units: int, resident: bool, clip: bool) -> str:
    """Why `spares` spare slots cannot be (empty: they can). Speculation needs clipping (without it Adam updates
    each unit as its gradient lands: nothing waits to speculate on) and the resident copy (the gradients wait
    there, landed in the gradient order, one post per piece); a unit whose optimizer the GPU holds needs no
    slot."""
    if not spares:
        return ""
    if not clip:
        return "speculative updates serve clipping (optim.max_grad_norm > 0)"
    if not resident:
        return "speculative updates need the resident copy (ipc.staging resident)"
    if spares + gpu_units > units:
        held = f"{gpu_units} of them on the GPU (engine.gpu_optimizer)"
        return f"the model has {units} units, {held}: at most {units - gpu_units} spare slots"
    return ""


def spare_bytes(layout: StoreLayout, unit: int, staging_bytes: int, hosts: int = 1) -> int:
    """Host memory one unit's spare slot takes on each of `hosts` hosts: its slice in the three fp32 state planes
    (one host: its tile), its whole tile in the resident copy, and the page tables of their mappings."""
    tile = layout.units[unit].tile
    data = largest_slice(tile, hosts) * 12 + tile * staging_bytes
    return data + page_table_bytes({"spare": data})


def auto_spares(layout: StoreLayout, gpu_units: int, room: int, staging_bytes: int, hosts: int = 1) -> int:
    """ipc.spare_slots auto: as many units, in spare_order, as `room` bytes of host memory hold, past those whose
    optimizer the GPU holds."""
    count, left = 0, room - SPARE_FIXED
    for unit in spare_order(layout)[: max(len(layout.units) - gpu_units, 0)]:
        left -= spare_bytes(layout, unit, staging_bytes, hosts)
        if left < 0:
            break
        count += 1
    return count


def page_table_bytes(parts: Mapping[str, int]) -> int:
    """The kernel's page tables for the store's mappings (8 bytes per 4 KiB page, per process that maps it):
    this RAM is in use although no process's PSS shows it."""
    return PAGE_TABLE_MAPPERS * sum(parts.values()) // 512


def host_checkpoints(offload: bool | int, saved: int) -> int:
    """How many of a step's `saved` activation checkpoints engine.offload_checkpoints (resolved) puts in
    pinned host memory: all (true), none (false), or the first N blocks' (N)."""
    if isinstance(offload, bool):
        return saved if offload else 0
    return min(offload, saved)


def compute_bytes(engine: EngineConfig, cuda: bool) -> int:
    """A value's bytes in the compute dtype (auto: bf16 on CUDA, fp32 on the CPU)."""
    if engine.compute_dtype == "auto":
        return 2 if cuda else 4
    return STAGING_BYTES[engine.compute_dtype]


def pinned_checkpoint_bytes(num_layers: int, hidden: int, engine: EngineConfig, batch: int, seq: int) -> int:
    """Pinned host RAM one executor takes for offloaded checkpoints (a resolved config; 0 if on the GPU)."""
    if engine.device != "cuda" or not engine.offload_checkpoints:
        return 0
    engine = fixed_sizes(engine)
    saved = len(blocks(num_layers, engine.checkpoint_interval, engine.last_block_layers)) - 1
    return host_checkpoints(engine.offload_checkpoints, saved) * batch * seq * hidden * compute_bytes(engine, True)


def process_terms(roles: Iterable[str], cuda: bool, launcher: bool, private_ray: bool) -> dict[str, int]:
    """Each process's own memory: the run's roles (an executor's CUDA context where the engine is on CUDA;
    the reaper's a few MiB; every other role's a CPU role's), then the node's: the launcher where it is a
    process of its own beside Ray's, and a private Ray instance's processes."""
    out = {}
    for role in roles:
        kind = REAPER if role == REAPER else EXECUTOR if kind_of(role) is Kind.EXECUTOR and cuda else "cpu-role"
        out[f"process: {role}"] = PROCESS_BYTES[kind]
    if launcher:
        out["node: the launcher (megatrain-launch)"] = PROCESS_BYTES["driver"]
        if private_ray:
            out["node: Ray's own processes (raylet, GCS, agents)"] = PROCESS_BYTES["ray"]
    return out


def host_terms(
    parts: Mapping[str, int], header_bytes: int, pinned: int, processes: Mapping[str, int]
) -> dict[str, int]:
    """The host part of a plan, term by term: the store's segments with their headers, the pinned
    checkpoints, the processes, and the page tables (the keys `megatrain-launch plan` prints)."""
    host = {f"shm: {k}": v + header_bytes for k, v in parts.items()}
    host[PINNED] = pinned
    host.update(processes)
    host[PAGE_TABLES] = page_table_bytes(parts)
    return host


# What host memory auto spare slots leave free: this share of the node's RAM, at least SPARE_HEADROOM_MIN (the
# processes' transient allocations, the page cache a data loader reads through, the plan's own error).
SPARE_HEADROOM_FRACTION, SPARE_HEADROOM_MIN = 0.03, 2 * GIB


def spare_room(shm_free: int, limit: int, total: int, shm_need: int, need: int) -> int:
    """Host memory spare slots may take beside a run that needs `need` bytes of RAM, `shm_need` of them in
    shared memory, on a node with `shm_free` free there, `limit` a run may take (Machine.limit) and `total` RAM."""
    headroom = max(int(SPARE_HEADROOM_FRACTION * total), SPARE_HEADROOM_MIN)
    return max(min(shm_free - shm_need, limit - need) - headroom, 0)


def resolve_spares(
    asked: int | str,
    layout: StoreLayout,
    gpu_units: int,
    *,
    resident: bool,
    clip: bool,
    hosts: int,
    room: int,
    staging_bytes: int,
) -> tuple[int, str]:
    """ipc.spare_slots resolved: (units with a spare slot, why), `room`: spare_room's bytes. A count that cannot
    be is refused with the reason (ValueError)."""
    units = len(layout.units)
    if asked != "auto":
        refusal = spare_refusal(int(asked), units, gpu_units, resident, clip)
        if refusal:
            raise ValueError(f"ipc.spare_slots {asked}: {refusal}")
        return int(asked), f"{asked}, as set"
    if gpu_units >= units:
        return 0, "none: the GPU holds every unit's optimizer (engine.gpu_optimizer)"
    refusal = spare_refusal(1, units, gpu_units, resident, clip)
    if refusal:
        return 0, f"none: {refusal}"
    count = auto_spares(layout, gpu_units, room, staging_bytes, hosts)
    if not count:
        return 0, f"none: the {room / GIB:.1f} GiB of host memory left beside the run holds no unit's slot"
    taken = sum(spare_bytes(layout, u, staging_bytes, hosts) for u in spare_order(layout)[:count])
    return count, (
        f"{count} of the {units - gpu_units} units Adam updates on the host, {taken / GIB:.1f} GiB, in the "
        f"{room / GIB:.1f} GiB of host memory left beside the run"
    )
