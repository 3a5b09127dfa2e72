"""The plan of a run's store: what lives where, the fetch and gradient orders as data, and who
handles which slab. Built once by the store owner; every process attaches with the same StoreSpec."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from megatrain.config.ipc import STALL_FLOOR_S, IpcConfig
from megatrain.errors import ProtocolError
from megatrain.flops import model_step_flops
from megatrain.ipc.cpus import Threads
from megatrain.ipc.protocol.ctl import CTL_FIXED, PIECE_BYTES
from megatrain.ipc.protocol.sems import semaphores
from megatrain.ipc.shared.shm import MAX_PIDS
from megatrain.memory.gpu import gpu_owners, gpu_units_refusal
from megatrain.memory.host import (
    SPARE_PLANES,
    SPARE_RESIDENT,
    STAGING_BYTES,
    StoreShape,
    page_table_bytes,
    pinned_checkpoint_bytes,
    spare_refusal,
)
from megatrain.memory.hosts import host_of, host_slice, largest_slice, slice_offsets
from megatrain.memory.plan import staging_by_rule
from megatrain.model.layout import PLANES as PLANES  # megatrain.ipc.protocol.PLANES: the layout's, re-exported
from megatrain.model.layout import StoreLayout
from megatrain.model.spec import ModelSpec
from megatrain.roster import slabs_refusal, slot_names
from megatrain.step.blocks import blocks
from megatrain.step.engine import EngineConfig

# The staging dtypes as torch has them, with their bytes (megatrain/memory/host.py STAGING_BYTES).
STAGING = {"bf16": (torch.bfloat16, STAGING_BYTES["bf16"]), "fp32": (torch.float32, STAGING_BYTES["fp32"])}


STALL_FLOPS = 100e12  # a rate any GPU the engine runs on exceeds on a layer's work: the estimate is an upper bound
STALL_FACTOR = 4


def resolve_stall(ipc: IpcConfig, spec: ModelSpec, batch: int, seq: int) -> IpcConfig:
    """ipc with an `auto` stall timeout resolved for the model and the tokens per step: a layer makes no
    data-plane progress while it computes (its recompute and backward, a tile at a time at long context),
    so the timeout covers STALL_FACTOR times its estimated work (the paper's formula, with its recompute)."""
    if ipc.stall_timeout_s != "auto":
        return ipc
    layer_s = model_step_flops(spec, batch, seq) * 4 / 3 / max(spec.layout.num_layers, 1) / STALL_FLOPS
    return dataclasses.replace(ipc, stall_timeout_s=round(max(STALL_FLOOR_S, STALL_FACTOR * layer_s), 1))


class Item(NamedTuple):
    """One slab's worth of a unit: elements [lo, hi) of its tile in slab `slab`; `piece` indexes the
    run's pieces (its version counter and squared gradient norm in ctl)."""

    unit: int
    lo: int
    hi: int
    slab: int
    piece: int


@dataclass(frozen=True)
class StoreSpec:
    """Everything a process needs to attach to a run's store; picklable, built by the store owner."""

    run_id: str
    model: ModelSpec
    staging_dtype: str
    checkpoint_interval: int
    num_packers: int
    num_accumulators: int
    ipc: IpcConfig = field(default_factory=IpcConfig)
    staging_mode: str = "slabs"  # resolved: "slabs" or "resident"
    clip: bool = True  # global-norm clipping: gradients wait in the grads plane until the norm is known
    last_block_layers: int = 0  # engine.last_block_layers: with K, fixes the order the engine fetches units
    threads: dict[str, Threads] = field(default_factory=dict)  # the node's CPU plan (cpus.py); empty: none
    cores: int = 0  # the cores the plan split
    num_executors: int = 1  # actors.num_gpus: executors sharing the store, each its rows of the batch
    # A run over several hosts: this store is host `host`'s of `hosts`. It holds slice `host` of every unit's
    # fp32 planes (megatrain/memory/hosts.py) and the whole resident copy its executors stream from.
    hosts: int = 1
    host: int = 0
    # engine.gpu_optimizer resolved: the first units of forward_order whose fp32 weights, Adam moments and
    # gradient the executor holds on its device and updates there (actors/executor/gpustate.py); Adam
    # updates the rest. Their state in the planes is what the executor last wrote back (for a checkpoint).
    gpu_units: int = 0
    # ipc.spare_slots resolved (settled with the engine's sizes, like gpu_units): the first `spares` units of the
    # gradient order have a spare slot, which Adam's speculative update writes into (ipc/protocol/adam.py).
    spares: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.host < self.hosts:
            raise ProtocolError(f"host {self.host} is not one of the run's {self.hosts} hosts")
        refusal = gpu_units_refusal(self.gpu_units, self.num_units, self.resident)
        if refusal:
            raise ProtocolError(f"engine.gpu_optimizer {self.gpu_units}: {refusal}")
        refusal = spare_refusal(self.spares, self.num_units, self.gpu_units, self.resident, self.clip)
        if refusal:
            raise ProtocolError(f"ipc.spare_slots {self.spares}: {refusal}")
        refusal = slabs_refusal(self.num_executors, self.hosts)
        if refusal and not self.resident:
            raise ProtocolError(f"ipc.staging {self.staging_mode}: {refusal}")

    @property
    def grads_in_resident(self) -> bool:
        """With a resident copy, each unit's gradient goes straight into the unit's own resident tile, in the
        compute dtype, as the executor made it, and waits there for Adam (with clipping, for the global
        norm). The tile's weights are not read again in the step once its gradient exists (the executor
        checks that), and Adam reads the gradient and writes the new weights in the same pass: no gradient
        plane, slabs or accumulators, 12 bytes per parameter plus the copy, clipping or not, and no slab
        for the backward to wait on while Adam is behind."""
        return self.shape.grads_in_resident

    # What fixes the segments' sizes is the store shape's (megatrain/memory/host.py), which the memory plan
    # counts with: the spec asks it, so that the plan and the store cannot disagree.
    @property
    def planes(self) -> tuple[str, ...]:
        """fp32 planes of this run (StoreShape.planes)."""
        return self.shape.planes

    @property
    def resident(self) -> bool:
        return self.shape.resident

    @property
    def num_grad_slabs(self) -> int:
        return self.shape.num_grad_slabs

    @property
    def num_weight_slabs(self) -> int:
        return self.shape.num_weight_slabs

    @property
    def staging_bytes(self) -> int:
        return self.shape.staging_bytes

    @property
    def layout(self) -> StoreLayout:
        return self.model.layout

    @property
    def num_units(self) -> int:
        return len(self.layout.units)

    @cached_property
    def shape(self) -> StoreShape:
        """What fixes the segments' sizes (megatrain/memory/host.py)."""
        return StoreShape(
            layout=self.layout,
            staging_mode=self.staging_mode,
            clip=self.clip,
            staging_dtype=self.staging_dtype,
            weight_slabs=self.ipc.weight_slabs,
            grad_slabs=self.ipc.grad_slabs,
            slab_params=self.ipc.slab_params,
            ctl_fixed=CTL_FIXED,
            ctl_piece_bytes=PIECE_BYTES,
            hosts=self.hosts,
            spares=self.spares,
        )

    @cached_property
    def spare_units(self) -> frozenset[int]:
        """The units with a spare slot (StoreShape.spare_units)."""
        return frozenset(self.shape.spare_units)

    @cached_property
    def spare_offsets(self) -> dict[int, int]:
        """Per unit with a spare slot, where its slot starts in each fp32 plane's spare slots (elements): its
        largest slice each (one host: its tile), as the planes lay out the units' slices."""
        return self._spare_offsets(self.hosts)

    @cached_property
    def spare_resident_offsets(self) -> dict[int, int]:
        """Per unit with a spare slot, where its slot starts in the resident copy's spare slots: its whole tile
        each, as the resident copy holds every unit whole."""
        return self._spare_offsets(1)

    def _spare_offsets(self, hosts: int) -> dict[int, int]:
        out, at = {}, 0
        for unit in self.shape.spare_units:
            out[unit] = at
            at += largest_slice(self.layout.units[unit].tile, hosts)
        return out

    def slot_elems(self, unit: int) -> int:
        """Elements of the unit's spare slot in each fp32 plane: its largest slice (one host: its tile)."""
        return largest_slice(self.layout.units[unit].tile, self.hosts)

    def pieces_of(self, unit: int) -> tuple[tuple[int, int, int], ...]:
        """The unit's pieces in this host's slice, as piece_table has them (one host: every piece)."""
        pieces = self.piece_table[unit]
        return pieces if self.hosts == 1 else tuple(p for p in pieces if self.owns(Item(unit, p[1], p[2], -1, p[0])))

    @property
    def spare_elems(self) -> int:
        return self.shape.spare_elems

    def spare_parts(self, *wanted: str) -> tuple[str, ...]:
        """The spare slots' segments this store has, of `wanted` (none: both): what a process that reads the
        state, or the resident copy, attaches to beside the planes."""
        return tuple(p for p in (SPARE_PLANES, SPARE_RESIDENT) if self.spares and (not wanted or p in wanted))

    @cached_property
    def slab_elems(self) -> int:
        return self.shape.slab_elems

    @cached_property
    def piece_table(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per unit, its pieces as (piece index, lo, hi): consecutive slab-sized ranges of its tile, cut at the
        hosts' slices (the same table on every host)."""
        table, n = [], 0
        for spans in self.shape.piece_spans:
            table.append(tuple((n + i, lo, hi) for i, (lo, hi) in enumerate(spans)))
            n += len(spans)
        return tuple(table)

    def owned(self, unit: int) -> tuple[int, int]:
        """Elements [lo, hi) of the unit's tile whose fp32 state this host holds (every element on one host),
        within the unit's own elements (never its tile's padding)."""
        return self.slice_of(unit, self.host)

    def slice_of(self, unit: int, host: int) -> tuple[int, int]:
        """Elements [lo, hi) of the unit's tile whose fp32 state host `host` holds, within the unit's own
        elements."""
        numel = self.layout.structure_of(unit).numel
        if self.hosts == 1:
            return 0, numel
        lo, hi = host_slice(self.layout.units[unit].tile, self.hosts, host)
        return min(lo, numel), min(hi, numel)

    def owns(self, item: Item) -> bool:
        """The piece is in this host's slice (its gradient, update and checkpoint are this host's)."""
        return self.hosts == 1 or host_of(self.layout.units[item.unit].tile, self.hosts, item.lo) == self.host

    @cached_property
    def slice_offsets(self) -> tuple[int, ...]:
        """Per unit, where its slice starts in this host's fp32 planes (one host: the unit's offset)."""
        return slice_offsets(self.layout, self.hosts)

    @property
    def plane_elems(self) -> int:
        """Elements of each fp32 plane on this host."""
        return self.shape.plane_elems

    @property
    def num_pieces(self) -> int:
        return self.shape.num_pieces

    def piece_range(self, unit: int) -> slice:
        """The unit's pieces as a slice of the per-piece ctl arrays."""
        pieces = self.piece_table[unit]
        return slice(pieces[0][0], pieces[-1][0] + 1)

    def _grouped(self, order: list[int], slabs: int) -> list[list[Item]]:
        """Per entry of `order`, the unit's pieces as items; item j of the whole walk uses slab j % slabs."""
        out: list[list[Item]] = []
        j = 0
        for unit in order:
            out.append([Item(unit, lo, hi, (j + i) % slabs, p) for i, (p, lo, hi) in enumerate(self.piece_table[unit])])
            j += len(out[-1])
        return out

    @cached_property
    def blocks(self) -> list[list[int]]:
        """The executor's checkpoint blocks: the engine recomputes exactly these (it takes them from here)."""
        return blocks(self.layout.num_layers, self.checkpoint_interval, self.last_block_layers)

    @cached_property
    def fetch_order(self) -> list[int]:
        return fetch_order(self.blocks)

    @cached_property
    def last_fetch(self) -> dict[int, int]:
        """Per unit, its last position in fetch_order: its weights are not read after that in a step."""
        return {u: i for i, u in enumerate(self.fetch_order)}

    @cached_property
    def forward_order(self) -> list[int]:
        return forward_order(self.layout.num_layers)

    @cached_property
    def grad_order(self) -> list[int]:
        return grad_order(self.layout.num_layers)

    @cached_property
    def fetch_items(self) -> list[list[Item]]:
        """Per fetch of engine.fetch_order, the unit's pieces (slabs mode: with their weight slabs)."""
        return self._grouped(self.fetch_order, max(self.num_weight_slabs, 1))

    @cached_property
    def forward_items(self) -> list[list[Item]]:
        """Per fetch of a forward-only pass (evaluation, generation), the unit's pieces. Like a step's walk it
        starts at weight slab 0: a walk ends with every slab freed, so walks of either kind may follow each
        other in any sequence the driver calls them in."""
        return self._grouped(self.forward_order, max(self.num_weight_slabs, 1))

    def walk(self, kind: str) -> tuple[list[int], list[list[Item]]]:
        """A weight walk: 'step' (training: forward, head, recompute) or 'forward' (forward and head only)."""
        if kind == "step":
            return self.fetch_order, self.fetch_items
        if kind == "forward":
            return self.forward_order, self.forward_items
        raise ProtocolError(f"unknown weight walk '{kind}'")

    @cached_property
    def emit_items(self) -> list[list[Item]]:
        """Per gradient of engine.grad_order, the unit's pieces with their gradient slabs; over several hosts,
        this host's pieces: the executor lands only its host's slice of each summed gradient."""
        items = self._grouped(self.grad_order, max(self.num_grad_slabs, 1))
        return items if self.hosts == 1 else [[it for it in unit if self.owns(it)] for unit in items]

    def weight_items(self, packer: int, walk: str = "step") -> list[Item]:
        """The items packer `packer` fills in one walk, in order (none in resident mode)."""
        if not self.num_weight_slabs:
            return []
        return [it for items in self.walk(walk)[1] for it in items if it.slab % self.num_packers == packer]

    @cached_property
    def on_gpu(self) -> frozenset[int]:
        """The units whose optimizer the executors hold on their devices (the first gpu_units of forward_order)."""
        return frozenset(self.forward_order[: self.gpu_units])

    @cached_property
    def gpu_owner(self) -> dict[int, int]:
        """Per unit of on_gpu, the executor that holds its state and updates it (megatrain/memory/gpu.py
        gpu_owners); the others receive its new weights from it."""
        return gpu_owners(self.layout, self.gpu_units, self.num_executors)

    @cached_property
    def cpu_items(self) -> list[Item]:
        """update_items less the units the executor updates on its device: what Adam updates."""
        return [it for it in self.update_items if it.unit not in self.on_gpu]

    @cached_property
    def update_items(self) -> list[Item]:
        """Every piece in the order Adam updates them (with clipping: forward order, so the next forward
        follows right behind; without: as the backward produces the gradients), those the executor updates on
        its device (on_gpu) included: Adam sums their squared norms too. A checkpoint writer takes them in this
        same order, so the next step's update of each piece follows right behind it."""
        if self.clip:
            items = [Item(u, lo, hi, -1, p) for u, pieces in enumerate(self.piece_table) for p, lo, hi in pieces]
            return [it for it in items if self.owns(it)] if self.hosts > 1 else items
        return self.grad_items(None)

    def grad_items(self, acc: int | None) -> list[Item]:
        """The items accumulator `acc` drains, in order; None: all of them (without clipping the Adam
        updater drains every slab itself)."""
        return [
            it for items in self.emit_items for it in items if acc is None or it.slab % self.num_accumulators == acc
        ]

    def part_bytes(self) -> dict[str, int]:
        return self.shape.part_bytes()

    def page_table_bytes(self) -> int:
        return page_table_bytes(self.part_bytes())

    def layout_hash(self) -> bytes:
        """What the segments' bytes mean. Not the checkpoint plan (K, the last block): it orders the walk,
        not the memory, and is settled after the store is made (actors/store_owner.py); nor the spare slots,
        settled then too, in segments of their own."""
        extra = (
            f"{self.clip}:{self.staging_mode}:"
            f"{self.staging_dtype}:{self.slab_elems}:{self.num_weight_slabs}:{self.num_grad_slabs}"
        ) + (f":host {self.host} of {self.hosts}" if self.hosts > 1 else "")
        return hashlib.sha256(self.layout.digest() + extra.encode()).digest()[:16]

    def roles(self) -> list[str]:
        """Worker role names; a role's index is its pid slot in ctl."""
        return slot_names(executors=self.num_executors, packers=self.num_packers, accumulators=self.num_accumulators)

    def pid_slot(self, role: str) -> int:
        """Where a worker records its pid in ctl, so cleanup can find what the CUDA driver left for it."""
        roles = self.roles()
        if role not in roles or roles.index(role) >= MAX_PIDS:
            raise ProtocolError(
                f"role '{role}' has no slot in the control segment (roles: {', '.join(roles)}; at most {MAX_PIDS})"
            )
        return roles.index(role)

    def sem_names(self) -> dict[str, tuple[str, int]]:
        """Semaphore key -> (name, initial value) (ipc/protocol/sems.py)."""
        return semaphores(self.run_id, self.num_weight_slabs, self.num_grad_slabs)


def plan_store(
    run_id: str,
    model: ModelSpec,
    staging_dtype: str,
    checkpoint_interval: int,
    num_packers: int,
    num_accumulators: int,
    ipc: IpcConfig,
    cuda: bool,
    clip: bool = True,
    last_block_layers: int = 0,
    executors: int = 1,
    hosts: int = 1,
    host: int = 0,
    gpu_units: int = 0,
    spares: int = 0,
) -> StoreSpec:
    """The store of ipc.staging as asked, or for 'auto' by staging_by_rule. Where the memory decides ('auto'
    on CUDA without clipping) the memory plan has decided it before (megatrain/memory/plan.py staging_mode):
    an 'auto' that reaches here is refused."""

    def make(mode: str) -> StoreSpec:
        return StoreSpec(
            run_id,
            model,
            staging_dtype,
            checkpoint_interval,
            num_packers,
            num_accumulators,
            ipc,
            mode,
            clip,
            last_block_layers,
            num_executors=executors,
            hosts=hosts,
            host=host,
            gpu_units=gpu_units,
            spares=spares,
        )

    mode = staging_by_rule(ipc.staging, cuda, clip, executors, hosts)
    if mode is None:
        raise ProtocolError(
            "ipc.staging 'auto' without clipping on CUDA is decided by the memory plan on the store's node "
            "(megatrain/memory/plan.py staging_mode): plan the store with the mode it decided"
        )
    return make(mode)


# ---- the orders: pure functions of the layer count and the checkpoint plan --------------------------
def fetch_order(blks: list[list[int]]) -> list[int]:
    """Units in the order the engine fetches weights: forward, head, then blocks recomputed in reverse.

    The last block runs with grad in the forward and keeps its graphs, so it is never recomputed."""
    num_layers = blks[-1][-1] if blks and blks[-1] else 0
    order = [0, *range(1, num_layers + 1), num_layers + 1]
    for blk in reversed(blks[:-1]):
        order += blk
    return order


def forward_order(num_layers: int) -> list[int]:
    """Units in the order a forward-only pass (evaluation, generation) fetches them: no recompute."""
    return [0, *range(1, num_layers + 1), num_layers + 1]


def grad_order(num_layers: int) -> list[int]:
    """Units in the order their gradients complete: head, layers last to first, embedding."""
    return [num_layers + 1, *range(num_layers, 0, -1), 0]


def checkpoint_host_bytes(spec: ModelSpec, cfg: EngineConfig, batch: int, seq: int) -> int:
    """Pinned host RAM the executor takes for offloaded checkpoints (a resolved config; 0 if on the GPU)."""
    return pinned_checkpoint_bytes(spec.layout.num_layers, spec.hf_config.hidden_size, cfg, batch, seq)
