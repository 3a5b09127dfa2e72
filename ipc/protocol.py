"""The data-plane protocol: what lives where in shared memory, who waits on what, in which order.

Segments of a run (all /megatrain-<run_id>-<part>):
  ctl         abort flag + reason, worker pids, per-piece version counters (Adam updates applied) and
              per-piece squared gradient norms
  params, exp_avg, exp_avg_sq, grads   fp32 planes, one 4 KiB-aligned tile per unit (grads: the
              fp32 gradient of the step, held until the global norm is known)
  staging     S weight slabs (compute dtype; slabs mode only) then G gradient slabs (fp32), each of
              slab_elems elements; the executor pins (cudaHostRegister) this segment and `resident`.
  resident    resident mode only: a compute-dtype copy of every unit's weights, rewritten by Adam's
              fused pass right after each unit's update; the DMA reads it directly (no packing).

A slab holds ipc.slab_params elements (default: the largest decoder layer), so a larger unit (the
embedding, the LM head, or any unit with smaller slabs) travels as several *pieces*: consecutive element
ranges of its tile, one slab each. Version counters and squared gradient norms are kept per piece, so
the next step may pack and copy a unit's first piece while Adam still updates its last.

Weights, per step, follow engine.fetch_order, piece by piece. Resident mode: the executor waits for
version[piece] >= step and copies the piece of the unit's resident tile. Slabs mode: item j uses weight
slab j % S, and slab s is always filled by packer s % P, so one packer handles a slab's uses in order:
  packer:   wait w_free[s]; wait version[piece] >= step; cast fp32 piece -> slab; post w_full[s]
  executor: wait w_full[s]; copy slab -> its range of the unit's device buffer; (copy done) post w_free[s]
A forward-only pass (evaluation, generation) walks engine.forward_order the same way, from slab 0.
Gradients follow engine.grad_order, piece by piece: item k uses grad slab k % G, drained by
accumulator (k % G) % A:
  executor:    wait g_free[s]; copy grad piece -> slab (GPU: record the slab's IPC event); post g_full[s]
  accumulator: wait g_full[s]; (GPU: synchronize the opened IPC event); norm^2 -> ctl; slab -> grads
               tile range; post g_free[s]; post grads_ready
  adam:        wait grads_ready once per piece; clip scale from the norms; update pieces in forward
               order, bumping version[piece] after each, which releases the next step's packers.
Without clipping there is no grads plane and no accumulator: the Adam updater itself waits
g_full[s] (and the slab's IPC event), updates the piece straight from the slab, bumps its version and
posts g_free[s], all while the executor is still running the backward.
Every wait is timed (ipc.wait_timeout_s) and polls the abort flag, so a dead peer never hangs a run.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import posix_ipc
import torch
from megatrain.ipc.shm import (
    CTL_PIDS_OFFSET,
    HEADER_BYTES,
    MAX_PIDS,
    Header,
    Segment,
    check_space,
    seg_name,
    sem_name,
)

from megatrain.configbase import opt
from megatrain.engine import fetch_order, forward_order, grad_order
from megatrain.errors import AbortError, ResourceError, WaitTimeout
from megatrain.layout import TILE_ALIGN, StoreLayout, round_up
from megatrain.model import ModelSpec

PLANES = ("params", "exp_avg", "exp_avg_sq", "grads")  # "grads" only when clipping needs the whole step
STAGING = {"bf16": (torch.bfloat16, 2), "fp32": (torch.float32, 4)}
_REASON_BYTES = 1024
_CTL_FIXED = CTL_PIDS_OFFSET + 8 * MAX_PIDS + _REASON_BYTES


@dataclass
class IpcConfig:
    weight_slabs: int = opt(4, "S: weight staging slabs (compute dtype, ipc.slab_params elements each).")
    grad_slabs: int = opt(4, "G: gradient staging slabs (fp32); back-pressure when all are in flight.")
    slab_params: int = opt(0, "Elements per staging slab; a larger unit streams in slab-sized pieces (weights "
                              "and gradients alike). 0 = the largest decoder layer, so only the embedding "
                              "and LM head are split. Smaller slabs take less pinned memory and more copies.")
    wait_timeout_s: float = opt(600.0, "Longest any data-plane wait may block before the run fails.")
    poll_s: float = opt(0.05, "How often a blocked wait re-checks the abort flag.")
    staging: str = opt("auto", "How weights reach the DMA: 'resident' (a pinned compute-dtype copy of the whole "
                               "model, rewritten by Adam; no packing on the critical path), 'slabs' (S slabs "
                               "filled just in time by the packers; O(layer) pinned memory), or 'auto' "
                               "(resident on cuda when it fits in memory, else slabs).")
    shm_dir: str = opt("/dev/shm", "Where POSIX shared memory lives (checked for free space before creating).")

    def __post_init__(self) -> None:
        if self.weight_slabs < 1 or self.grad_slabs < 1:
            raise ValueError("ipc.weight_slabs and ipc.grad_slabs must be >= 1")
        if self.slab_params < 0:
            raise ValueError("ipc.slab_params must be >= 0 (0 = the largest decoder layer)")
        if self.staging not in ("auto", "resident", "slabs"):
            raise ValueError(f"ipc.staging must be auto, resident or slabs, not '{self.staging}'")
        if self.wait_timeout_s <= 0 or self.poll_s <= 0:
            raise ValueError("ipc.wait_timeout_s and ipc.poll_s must be > 0")


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

    @property
    def planes(self) -> tuple[str, ...]:
        """fp32 planes of this run: without clipping Adam consumes gradient slabs directly (12 B/param)."""
        return PLANES if self.clip else PLANES[:3]

    @property
    def resident(self) -> bool:
        return self.staging_mode == "resident"

    @property
    def num_weight_slabs(self) -> int:
        return 0 if self.resident else self.ipc.weight_slabs

    @property
    def staging_bytes(self) -> int:
        return STAGING[self.staging_dtype][1]

    @property
    def layout(self) -> StoreLayout:
        return self.model.layout

    @property
    def num_units(self) -> int:
        return len(self.layout.units)

    @cached_property
    def slab_elems(self) -> int:
        layout = self.layout
        layers = [layout.structure_of(u.index).numel for u in layout.units if u.kind == "layer"]
        limit = self.ipc.slab_params or max(layers, default=layout.max_unit_numel)
        return round_up(max(min(limit, layout.max_unit_numel), 1), TILE_ALIGN)

    @cached_property
    def piece_table(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per unit, its pieces as (piece index, lo, hi): consecutive slab-sized ranges of its tile."""
        e, table, n = self.slab_elems, [], 0
        for u in range(self.num_units):
            numel = self.layout.structure_of(u).numel
            spans = [(lo, min(lo + e, numel)) for lo in range(0, max(numel, 1), e)]
            table.append(tuple((n + i, lo, hi) for i, (lo, hi) in enumerate(spans)))
            n += len(spans)
        return tuple(table)

    @property
    def num_pieces(self) -> int:
        return self.piece_table[-1][-1][0] + 1

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
    def fetch_order(self) -> list[int]:
        return fetch_order(self.layout.num_layers, self.checkpoint_interval, self.last_block_layers)

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
        raise ValueError(f"unknown weight walk '{kind}'")

    @cached_property
    def emit_items(self) -> list[list[Item]]:
        """Per gradient of engine.grad_order, the unit's pieces with their gradient slabs."""
        return self._grouped(self.grad_order, self.ipc.grad_slabs)

    def weight_items(self, packer: int, walk: str = "step") -> list[Item]:
        """The items packer `packer` fills in one walk, in order (none in resident mode)."""
        if not self.num_weight_slabs:
            return []
        return [it for items in self.walk(walk)[1] for it in items if it.slab % self.num_packers == packer]

    def grad_items(self, acc: int | None) -> list[Item]:
        """The items accumulator `acc` drains, in order; None: all of them (without clipping the Adam
        updater drains every slab itself)."""
        return [it for items in self.emit_items for it in items
                if acc is None or it.slab % self.num_accumulators == acc]

    def part_bytes(self) -> dict[str, int]:
        plane = self.layout.total * 4
        staging = self.slab_elems * (self.num_weight_slabs * self.staging_bytes + self.ipc.grad_slabs * 4)
        ctl = _CTL_FIXED + self.num_pieces * 16
        resident = {"resident": self.layout.total * self.staging_bytes} if self.resident else {}
        return {**dict.fromkeys(self.planes, plane), "staging": staging, **resident, "ctl": ctl}

    def layout_hash(self) -> bytes:
        extra = (f"{self.clip}:{self.checkpoint_interval}:{self.last_block_layers}:{self.staging_mode}:"
                 f"{self.staging_dtype}:{self.slab_elems}:{self.num_weight_slabs}:{self.ipc.grad_slabs}")
        return hashlib.sha256(self.layout.digest() + extra.encode()).digest()[:16]

    def roles(self) -> list[str]:
        """Worker role names; a role's index is its pid slot in ctl."""
        return (["gpu-executor", "adam-updater"] + [f"packer-{i}" for i in range(self.num_packers)]
                + [f"grad-accumulator-{i}" for i in range(self.num_accumulators)])

    def pid_slot(self, role: str) -> int:
        """Where a worker records its pid in ctl, so cleanup can find what the CUDA driver left for it."""
        slot = self.roles().index(role)
        assert slot < MAX_PIDS, role
        return slot

    def sem_names(self) -> dict[str, tuple[str, int]]:
        """Semaphore key -> (name, initial value)."""
        out = {"grads_ready": (sem_name(self.run_id, "grads-ready"), 0)}
        for kind, n in (("w", self.num_weight_slabs), ("g", self.ipc.grad_slabs)):
            for i in range(n):
                out[f"{kind}_free{i}"] = (sem_name(self.run_id, f"{kind}free{i}"), 1)
                out[f"{kind}_full{i}"] = (sem_name(self.run_id, f"{kind}full{i}"), 0)
        return out


def plan_store(run_id: str, model: ModelSpec, staging_dtype: str, checkpoint_interval: int, num_packers: int,
               num_accumulators: int, ipc: IpcConfig, cuda: bool, clip: bool = True,
               ram_only: dict[str, int] | None = None, last_block_layers: int = 0) -> StoreSpec:
    """Resolve ipc.staging: as asked, or for 'auto' resident on cuda when it fits in memory, else slabs."""
    def make(mode: str) -> StoreSpec:
        return StoreSpec(run_id, model, staging_dtype, checkpoint_interval, num_packers, num_accumulators, ipc, mode,
                         clip, last_block_layers)

    if ipc.staging != "auto":
        return make(ipc.staging)
    if not cuda:
        return make("slabs")  # no DMA to feed: a resident copy would only cost memory
    resident = make("resident")
    try:
        check_space(resident.part_bytes(), ipc.shm_dir, ram_only)
        return resident
    except ResourceError:
        return make("slabs")


class Store:
    """A process's view of the run's shared memory: planes, slabs, control block, semaphores."""

    def __init__(self, spec: StoreSpec, segments: dict[str, Segment], sems: dict[str, posix_ipc.Semaphore]):
        self.spec, self.segments, self.sems = spec, segments, sems
        self._unlinked = False
        ctl = segments["ctl"].mm
        u = spec.num_pieces
        self._flags = np.frombuffer(ctl, np.int64, 8, HEADER_BYTES)
        self.pids = np.frombuffer(ctl, np.int64, MAX_PIDS, HEADER_BYTES + CTL_PIDS_OFFSET)
        self._reason = np.frombuffer(ctl, np.uint8, _REASON_BYTES, HEADER_BYTES + CTL_PIDS_OFFSET + 8 * MAX_PIDS)
        self.versions = np.frombuffer(ctl, np.int64, u, HEADER_BYTES + _CTL_FIXED)
        self.sqnorms = np.frombuffer(ctl, np.float64, u, HEADER_BYTES + _CTL_FIXED + 8 * u)

    # ---- lifecycle -------------------------------------------------------------------------
    @classmethod
    def create(cls, spec: StoreSpec, ram_only: dict[str, int] | None = None) -> Store:
        """Owner only: check space, create every segment (ctl first) and semaphore, zeroed."""
        parts = spec.part_bytes()
        check_space(parts, spec.ipc.shm_dir, ram_only)
        hdr = Header(spec.layout_hash(), spec.run_id)
        segments: dict[str, Segment] = {}
        sems: dict[str, posix_ipc.Semaphore] = {}
        try:  # ctl first: it names the owner for the sweeper
            segments["ctl"] = Segment.create(seg_name(spec.run_id, "ctl"), parts["ctl"], hdr)
            for part in [p for p in parts if p != "ctl"]:
                segments[part] = Segment.create(seg_name(spec.run_id, part), parts[part], hdr)
            for key, (name, initial) in spec.sem_names().items():
                sems[key] = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=initial)
        except BaseException:
            for sem in sems.values():
                sem.unlink()
            for seg in segments.values():
                seg.unlink()
            raise
        return cls(spec, segments, sems)

    @classmethod
    def attach(cls, spec: StoreSpec, parts: tuple[str, ...], role: str | None = None) -> Store:
        """Attach (never create); a worker `role` records its pid for cleanup after a crash."""
        h = spec.layout_hash()
        segments = {p: Segment.attach(seg_name(spec.run_id, p), h, spec.run_id) for p in ("ctl", *parts)}
        sems = {k: posix_ipc.Semaphore(name) for k, (name, _) in spec.sem_names().items()}
        store = cls(spec, segments, sems)
        if role is not None:
            store.pids[spec.pid_slot(role)] = os.getpid()
        return store

    def unlink(self) -> None:
        """Owner only, idempotent. Names go away now; memory goes when the last process unmaps."""
        if self._unlinked:
            return
        self._unlinked = True
        for key, (name, _) in self.spec.sem_names().items():
            try:
                posix_ipc.unlink_semaphore(name)
            except posix_ipc.ExistentialError:
                pass
            if key in self.sems:
                self.sems[key].close()
        for seg in reversed(list(self.segments.values())):  # ctl last: the reaper watches it
            seg.unlink()

    def close(self) -> None:
        for s in self.sems.values():
            try:
                s.close()
            except posix_ipc.ExistentialError:
                pass

    # ---- memory views ----------------------------------------------------------------------
    def plane(self, part: str) -> np.ndarray:
        return np.frombuffer(self.segments[part].mm, np.float32, self.spec.layout.total, HEADER_BYTES)

    def tile(self, part: str, unit: int) -> np.ndarray:
        u = self.spec.layout.units[unit]
        n = self.spec.layout.structure_of(unit).numel
        return np.frombuffer(self.segments[part].mm, np.float32, n, HEADER_BYTES + 4 * u.offset)

    def torch_tile(self, part: str, unit: int) -> torch.Tensor:
        return torch.from_numpy(self.tile(part, unit))

    def resident_tile(self, unit: int) -> torch.Tensor:
        """The unit's compute-dtype copy (resident mode)."""
        u = self.spec.layout.units[unit]
        n = self.spec.layout.structure_of(unit).numel
        return torch.frombuffer(self.segments["resident"].mm, dtype=STAGING[self.spec.staging_dtype][0], count=n,
                                offset=HEADER_BYTES + u.offset * self.spec.staging_bytes)

    def refresh_resident(self, unit: int, lo: int = 0, hi: int | None = None) -> None:
        """Rewrite elements [lo, hi) of the unit's compute-dtype copy from its fp32 params (torch's cast:
        round to nearest even)."""
        self.resident_tile(unit)[lo:hi].copy_(self.torch_tile("params", unit)[lo:hi])

    def weight_slab(self, i: int) -> torch.Tensor:
        dtype, size = STAGING[self.spec.staging_dtype]
        assert i < self.spec.num_weight_slabs, "no weight slabs in resident mode"
        off = HEADER_BYTES + i * self.spec.slab_elems * size
        return torch.frombuffer(self.segments["staging"].mm, dtype=dtype, count=self.spec.slab_elems, offset=off)

    def grad_slab(self, i: int) -> torch.Tensor:
        w = self.spec.num_weight_slabs * self.spec.slab_elems * self.spec.staging_bytes
        off = HEADER_BYTES + w + i * self.spec.slab_elems * 4
        return torch.frombuffer(self.segments["staging"].mm, dtype=torch.float32, count=self.spec.slab_elems,
                                offset=off)

    def region(self, part: str) -> torch.Tensor:
        """A segment's whole data area as bytes (what the executor pins)."""
        seg = self.segments[part]
        return torch.frombuffer(seg.mm, dtype=torch.uint8, count=seg.data_bytes, offset=HEADER_BYTES)

    # ---- abort and waits ---------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        if self._flags[0]:
            return  # keep the first (root) cause
        raw = reason.encode()[: _REASON_BYTES - 1]
        self._reason[:] = 0
        self._reason[: len(raw)] = np.frombuffer(raw, np.uint8)
        self._flags[0] = 1

    @property
    def aborted(self) -> bool:
        return bool(self._flags[0])

    def abort_reason(self) -> str:
        return bytes(self._reason).rstrip(b"\0").decode(errors="replace")

    def check_abort(self) -> None:
        if self._flags[0]:
            raise AbortError(f"run aborted: {self.abort_reason()}")

    def wait(self, key: str, what: str) -> None:
        """Acquire semaphore `key`, polling the abort flag; WaitTimeout past ipc.wait_timeout_s."""
        sem, cfg = self.sems[key], self.spec.ipc
        deadline = time.monotonic() + cfg.wait_timeout_s
        while True:
            self.check_abort()
            try:
                sem.acquire(cfg.poll_s)
                return
            except posix_ipc.BusyError:
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"waited {cfg.wait_timeout_s:g}s for {what}") from None

    def post(self, key: str) -> None:
        self.sems[key].release()

    def wait_version(self, unit: int, version: int, what: str, piece: int | None = None) -> None:
        """Wait until Adam's version of the unit's `piece` (None: of all its pieces) reaches `version`
        (shared counters; Adam bumps a piece's after writing it)."""
        counters = self.versions[self.spec.piece_range(unit) if piece is None else slice(piece, piece + 1)]
        if counters.min() >= version:
            return
        cfg, nap = self.spec.ipc, 1e-4
        deadline = time.monotonic() + cfg.wait_timeout_s
        while counters.min() < version:
            self.check_abort()
            if time.monotonic() > deadline:
                raise WaitTimeout(f"waited {cfg.wait_timeout_s:g}s for {what}")
            time.sleep(nap)
            nap = min(nap * 2, cfg.poll_s)
