"""A process's view of a run's store: segments, semaphores, the abort flag, version counters and the
role table that heartbeats and stall detection read. Every wait is timed and polls the abort flag."""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import weakref

import numpy as np
import posix_ipc
import torch

from megatrain.errors import AbortError, Origin, ProtocolError, ResourceError, WaitTimeout
from megatrain.host.hostmem import release_range
from megatrain.ipc.protocol.ctl import (
    ABORT_AT,
    ABORT_ORIGIN,
    ABORTED,
    ABOUT_BYTES,
    BEAT,
    CALLS,
    PROGRESS,
    VERDICT_NORM,
    VERDICT_SCALE,
    VERDICT_STEPS,
    WAIT_SINCE,
    WAITS,
    WHAT_BYTES,
    WHAT_OFFSET,
    CtlView,
    write_text,
)
from megatrain.ipc.protocol.plan import STAGING, StoreSpec
from megatrain.ipc.shared.fence import load, publish, publish_all, reached
from megatrain.ipc.shared.segments import classify
from megatrain.ipc.shared.shm import (
    HEADER_BYTES,
    Header,
    Segment,
    check_space,
    run_entries,
    run_of_host,
    seg_name,
)
from megatrain.memory.host import SPARE_PLANES, SPARE_RESIDENT
from megatrain.model.layout import STATE_PLANES
from megatrain.roster import on_host, shown

BEAT_S = 1.0
# A counter wait sleeps in naps that grow from NAP_MIN_S to NAP_MAX_S: a published version is seen
# within about NAP_MAX_S plus the scheduler's wake-up (bench/wake.py measures it), at a cost of a few
# thousand wake-ups a second per blocked waiter. A 50 ms cap (the abort poll) once delayed a version
# published at 60 ms until 102 ms, and the next forward with it.
NAP_MIN_S, NAP_MAX_S = 2e-5, 5e-4


class Store:
    """A process's view of the run's shared memory: planes, slabs, control block, semaphores."""

    def __init__(self, spec: StoreSpec, segments: dict[str, Segment], sems: dict[str, posix_ipc.Semaphore]):
        self.spec, self.segments, self.sems = spec, segments, sems
        self._unlinked = False
        self.ctl = CtlView(segments["ctl"].mm, spec.num_pieces, HEADER_BYTES)  # the layout: ipc/protocol/ctl.py
        self._flags, self.pids, self.role_words, self.role_bytes = (
            self.ctl.flags,
            self.ctl.pids,
            self.ctl.role_words,
            self.ctl.role_bytes,
        )
        self.versions, self.sqnorms, self.saved = self.ctl.versions, self.ctl.sqnorms, self.ctl.saved
        self.banks = self.ctl.banks  # per unit: 0 its state in its tile, 1 in its spare slot
        self.slot: int | None = None  # this process's role row, if it is a worker
        self._row_lock = threading.Lock()

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
        except BaseException as exc:
            for sem in sems.values():
                sem.unlink()
            for seg in segments.values():
                seg.unlink()
            if isinstance(exc, posix_ipc.ExistentialError):  # said as `status` says it (ipc/shared/segments.py)
                rid, shm_dir = spec.run_id, spec.ipc.shm_dir
                raise ResourceError(classify(rid, run_entries(shm_dir).get(rid, []), shm_dir).refusal()) from None
            raise
        return cls(spec, segments, sems)

    @classmethod
    def attach(cls, spec: StoreSpec, parts: tuple[str, ...], role: str | None = None) -> Store:
        """Attach (never create); a worker `role` records its pid for cleanup after a crash and starts
        publishing its heartbeat and progress in the role table."""
        h = spec.layout_hash()
        segments = {p: Segment.attach(seg_name(spec.run_id, p), h, spec.run_id) for p in ("ctl", *parts)}
        sems = {k: posix_ipc.Semaphore(name) for k, (name, _) in spec.sem_names().items()}
        store = cls(spec, segments, sems)
        if role is not None:
            store.slot = spec.pid_slot(role)
            now = time.monotonic()
            store.role_words[store.slot, [BEAT, PROGRESS]] = now
            store.pids[store.slot] = os.getpid()
            _Heartbeat.register(store)
        return store

    def add_spares(self, spec: StoreSpec) -> None:
        """Owner only: the store settled with its spare slots (`spec`, this store's with `spares` set): their
        segments, made now (the memory they take is known only once the engine's sizes are), zeroed."""
        if spec.layout_hash() != self.spec.layout_hash():
            raise ProtocolError("the spare slots belong to another store's layout")
        hdr = Header(spec.layout_hash(), spec.run_id)
        for part, size in spec.part_bytes().items():
            if part not in self.segments:
                self.segments[part] = Segment.create(seg_name(spec.run_id, part), size, hdr)
        self.spec = spec

    def write_about(self, extra: dict | None = None) -> None:
        """Owner only: describe the run in ctl (role names by slot, pieces, model, and what the driver adds:
        output directory, steps), so `megatrain-launch status` can read it without the StoreSpec."""
        spec = self.spec
        about = {
            "roles": spec.roles(),
            "pieces": spec.num_pieces,
            "family": spec.model.family,
            "layers": spec.layout.num_layers,
            "params": spec.layout.num_params,
            "staging": spec.staging_mode,
            "clip": spec.clip,
            "created": time.time(),
            # over several hosts, each host's store says whose host it is (status shows it under its run)
            **(
                {"run": run_of_host(spec.run_id, spec.host), "host": spec.host, "hosts": spec.hosts}
                if spec.hosts > 1
                else {}
            ),
            **(extra or {}),
        }
        raw = json.dumps(about).encode()
        for key in [k for k in (extra or {}) if len(raw) >= ABOUT_BYTES]:  # a very long path: drop, not fail
            about.pop(key)
            raw = json.dumps(about).encode()
        write_text(self.ctl.about, raw)

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
        _Heartbeat.unregister(self)
        for s in self.sems.values():
            try:
                s.close()
            except posix_ipc.ExistentialError:
                pass

    # ---- memory views ----------------------------------------------------------------------
    def plane(self, part: str) -> np.ndarray:
        """An fp32 plane whole: this host's slices of every unit (one host: every unit's tile)."""
        return np.frombuffer(self.segments[part].mm, np.float32, self.spec.plane_elems, HEADER_BYTES)

    def tile(self, part: str, unit: int, spare: bool = False) -> np.ndarray:
        """The unit's elements in an fp32 plane that this host holds: its whole tile on one host, its slice
        (StoreSpec.owned) over several, whose element 0 is the slice's first. Of a unit with a spare slot, the
        bank that holds its state (ctl's bank word), or with `spare` the other one: where a speculative update
        writes. The bank is read here, at each call: a reader after a version wait sees the bank Adam turned
        before publishing it."""
        lo, hi = self.spec.owned(unit)
        if part in STATE_PLANES and self._in_spare(unit, spare):  # the gradient plane has no spare slots
            k, spec = STATE_PLANES.index(part), self.spec
            where = HEADER_BYTES + 4 * (k * spec.spare_elems + spec.spare_offsets[unit])
            return np.frombuffer(self.segments[SPARE_PLANES].mm, np.float32, hi - lo, where)
        return np.frombuffer(
            self.segments[part].mm, np.float32, hi - lo, HEADER_BYTES + 4 * self.spec.slice_offsets[unit]
        )

    def state_bytes(self, part: str, unit: int) -> tuple[np.ndarray, int]:
        """(bytes, first): an fp32 state plane's bytes that hold the unit's state, padding included, and the byte
        of the plane (its layout, as a checkpoint's files have it) where they start. In its tile: the whole
        plane, from 0; in its spare slot: the slot alone, from where its tile starts."""
        if not self._in_spare(unit, False):
            return self.plane(part).view(np.uint8), 0
        spec = self.spec
        where = HEADER_BYTES + 4 * (STATE_PLANES.index(part) * spec.spare_elems + spec.spare_offsets[unit])
        slot = np.frombuffer(self.segments[SPARE_PLANES].mm, np.uint8, 4 * spec.slot_elems(unit), where)
        return slot, 4 * spec.slice_offsets[unit]

    def _in_spare(self, unit: int, spare: bool) -> bool:
        """Whether the unit's bank asked for (its state's, or with `spare` the other) is its spare slot."""
        if unit not in self.spec.spare_units:
            if spare:
                raise ProtocolError(f"unit {unit} has no spare slot (ipc.spare_slots {self.spec.spares})")
            return False
        return bool(self.banks[unit]) != spare

    def turn_bank(self, unit: int) -> None:
        """Adam: the unit's spare slot, written by a speculative update, becomes its state (and its tile the
        spare slot). Before the unit's versions are published, which order it for every reader."""
        if unit not in self.spec.spare_units:
            raise ProtocolError(f"unit {unit} has no spare slot to turn to (ipc.spare_slots {self.spec.spares})")
        self.banks[unit] ^= 1

    def reset_banks(self) -> None:
        """Every unit's state in its own tile (a store whose planes were just read back from a checkpoint)."""
        self.banks[:] = 0

    def span(self, part: str, unit: int, lo: int, hi: int, spare: bool = False) -> np.ndarray:
        """Elements [lo, hi) of the unit's tile (the tile's own numbering) in an fp32 plane; they must be this
        host's. `spare`: in the bank that does not hold its state (Store.tile)."""
        first, last = self.spec.owned(unit)
        if not first <= lo <= hi <= last:
            raise ProtocolError(
                f"elements [{lo}, {hi}) of unit {unit} are not in host {self.spec.host}'s slice [{first}, {last})"
            )
        return self.tile(part, unit, spare)[lo - first : hi - first]

    def release(self, part: str, unit: int) -> int:
        """Give the pages of the unit's tile in an fp32 plane back to the system (megatrain/host/hostmem.py
        release_range), for every process mapping it: the state of a unit the GPU holds (StoreSpec.on_gpu) while
        nothing on the host reads it. It reads as zeros until written again. The bytes given back."""
        tile = self.tile(part, unit)
        return release_range(tile.ctypes.data, tile.nbytes)

    def torch_tile(self, part: str, unit: int) -> torch.Tensor:
        return torch.from_numpy(self.tile(part, unit))

    def resident_tile(self, unit: int, spare: bool = False) -> torch.Tensor:
        """The unit's compute-dtype copy (resident mode), in the bank that holds its state (`spare`: the other)."""
        spec = self.spec
        n = spec.layout.structure_of(unit).numel
        part, at = (
            (SPARE_RESIDENT, spec.spare_resident_offsets[unit])
            if self._in_spare(unit, spare)
            else ("resident", spec.layout.units[unit].offset)
        )
        return torch.frombuffer(
            self.segments[part].mm,
            dtype=STAGING[spec.staging_dtype][0],
            count=n,
            offset=HEADER_BYTES + at * spec.staging_bytes,
        )

    def grad_tile(self, unit: int) -> np.ndarray:
        """The unit's gradient as Adam reads it with clipping: its tile of the fp32 grads plane or, with
        grads_in_resident, its resident tile in the compute dtype (bf16 as uint16 bits, which the AdamW
        kernel widens as it reads them)."""
        if not self.spec.grads_in_resident:
            return self.tile("grads", unit)
        tile = self.resident_tile(unit)
        return tile.view(torch.int16).numpy().view(np.uint16) if tile.dtype == torch.bfloat16 else tile.numpy()

    def refresh_resident(self, unit: int, lo: int | None = None, hi: int | None = None, spare: bool = False) -> None:
        """Rewrite elements [lo, hi) of the unit's compute-dtype copy from its fp32 params (torch's cast:
        round to nearest even); `spare`: in the bank that does not hold its state."""
        first, last = self.spec.owned(unit)  # default: all this host holds
        lo, hi = first if lo is None else lo, last if hi is None else hi
        params = torch.from_numpy(self.span("params", unit, lo, hi, spare))
        self.resident_tile(unit, spare)[lo:hi].copy_(params)

    def weight_slab(self, i: int) -> torch.Tensor:
        dtype, size = STAGING[self.spec.staging_dtype]
        if i >= self.spec.num_weight_slabs:
            raise ProtocolError(
                f"weight slab {i} does not exist ({self.spec.num_weight_slabs} in {self.spec.staging_mode} mode)"
            )
        off = HEADER_BYTES + i * self.spec.slab_elems * size
        return torch.frombuffer(self.segments["staging"].mm, dtype=dtype, count=self.spec.slab_elems, offset=off)

    def grad_slab(self, i: int) -> torch.Tensor:
        w = self.spec.num_weight_slabs * self.spec.slab_elems * self.spec.staging_bytes
        off = HEADER_BYTES + w + i * self.spec.slab_elems * 4
        return torch.frombuffer(
            self.segments["staging"].mm, dtype=torch.float32, count=self.spec.slab_elems, offset=off
        )

    def region(self, part: str) -> torch.Tensor:
        """A segment's whole data area as bytes (what the executor pins)."""
        seg = self.segments[part]
        return torch.frombuffer(seg.mm, dtype=torch.uint8, count=seg.data_bytes, offset=HEADER_BYTES)

    # ---- abort -------------------------------------------------------------------------------
    def abort(self, reason: str, origin: Origin = Origin.RAISE) -> None:
        """Raise this host's abort flag with `reason`, unless it is up: the first watcher to see a failure
        decides what the host says of it; the ones after it see only its consequences."""
        if self._flags[ABORTED]:
            return  # keep the first (root) cause
        write_text(self.ctl.reason, reason)
        self._flags[ABORT_ORIGIN], self._flags[ABORT_AT] = int(origin), time.time_ns()
        self._flags[ABORTED] = 1  # last: a reader that sees the flag sees the reason

    @property
    def aborted(self) -> bool:
        return bool(self._flags[ABORTED])

    def abort_reason(self) -> str:
        return self.ctl.abort_reason()

    def abort_error(self) -> AbortError:
        """The raised flag as the error every wait of this host ends with, its origin and time with it."""
        at = int(self._flags[ABORT_AT]) / 1e9
        return AbortError(f"run aborted: {self.abort_reason()}", int(self._flags[ABORT_ORIGIN]), at)

    def check_abort(self) -> None:
        if self._flags[ABORTED]:
            raise self.abort_error()

    def label(self, role: str) -> str:
        """This host's role `role` as messages name it: over several hosts with its host (roster.shown)."""
        return shown(on_host(role, self.spec.host), self.spec.hosts)

    # ---- progress (the role table) -------------------------------------------------------------
    def progressed(self) -> None:
        if self.slot is not None:
            self.role_words[self.slot, PROGRESS] = time.monotonic()

    def call_started(self) -> None:
        """A driver call began (entering one counts as progress: the monitor times from here)."""
        if self.slot is not None:
            with self._row_lock:
                self.role_words[self.slot, CALLS] += 1
                self.role_words[self.slot, PROGRESS] = time.monotonic()

    def call_ended(self) -> None:
        if self.slot is not None:
            with self._row_lock:
                self.role_words[self.slot, CALLS] -= 1

    def _waiting(self, what: str, delta: int) -> None:
        if self.slot is None:
            return
        with self._row_lock:
            row = self.role_words[self.slot]
            row[WAITS] += delta
            if delta > 0:
                row[WAIT_SINCE] = time.monotonic()
                write_text(self.role_bytes[self.slot, WHAT_OFFSET : WHAT_OFFSET + WHAT_BYTES], what)
            else:
                row[PROGRESS] = time.monotonic()

    def waiting_on(self, slot: int) -> str:
        return self.ctl.waiting_on(slot)

    # ---- waits and hand-offs -----------------------------------------------------------------
    def wait(self, key: str, what: str) -> None:
        """Acquire semaphore `key`, polling the abort flag; WaitTimeout past ipc.wait_timeout_s."""
        sem, cfg = self.sems[key], self.spec.ipc
        self.check_abort()  # even an available semaphore is not taken after an abort
        try:
            sem.acquire(0)  # the common case on the hot path: no bookkeeping of a wait
            self.progressed()
            return
        except posix_ipc.BusyError:
            pass
        deadline = time.monotonic() + cfg.wait_timeout_s
        self._waiting(what, +1)
        try:
            while True:
                self.check_abort()
                try:
                    sem.acquire(cfg.poll_s)
                    return
                except posix_ipc.BusyError:
                    if time.monotonic() > deadline:
                        raise WaitTimeout(f"waited {cfg.wait_timeout_s:g}s for {what}") from None
        finally:
            self._waiting(what, -1)

    def poll(self, key: str) -> bool:
        """Acquire semaphore `key` if it is available now (True), without waiting (False)."""
        self.check_abort()
        try:
            self.sems[key].acquire(0)
        except posix_ipc.BusyError:
            return False
        self.progressed()
        return True

    def post(self, key: str) -> None:
        self.sems[key].release()
        self.progressed()

    def publish_version(self, piece: int, version: int) -> None:
        """Adam's update of the piece for step version-1 is complete: release it (after a fence)."""
        publish(self.versions, piece, version)
        self.progressed()

    def publish_versions(self, version: int) -> None:
        """Every piece at `version` (a store restored from the checkpoint of that step), after a fence."""
        publish_all(self.versions, version)
        self.progressed()

    def version(self, piece: int) -> int:
        """The piece's version counter, read between fences (see fence.load)."""
        return int(load(self.versions, piece))

    def wait_version(self, unit: int, version: int, what: str, piece: int | None = None) -> None:
        """Wait until Adam's version of the unit's `piece` (None: of all its pieces) reaches `version`;
        the reads that follow see Adam's writes (acquire fence)."""
        span = self.spec.piece_range(unit) if piece is None else slice(piece, piece + 1)
        self._wait_reached(self.versions, span, version, what)

    def publish_verdict(self, step: int, norm: float, scale: float) -> None:
        """Adam has the global gradient norm of step `step` (0-based) and its clip scale: published (norm and
        scale first, then the count of steps judged, after a fence) for the units the GPU updates."""
        words = self._flags.view(np.float64)
        words[VERDICT_NORM], words[VERDICT_SCALE] = norm, scale
        publish(self._flags, VERDICT_STEPS, step + 1)
        self.progressed()

    def wait_verdict(self, step: int) -> tuple[float, float]:
        """Wait for Adam's verdict on step `step`: (global norm, clip scale)."""
        self._wait_reached(
            self._flags, slice(VERDICT_STEPS, VERDICT_STEPS + 1), step + 1, f"Adam's gradient norm of step {step}"
        )
        words = self._flags.view(np.float64)
        return float(words[VERDICT_NORM]), float(words[VERDICT_SCALE])

    def publish_saved(self, piece: int, step: int) -> None:
        """The checkpoint writer has the piece's state after `step` on disk: Adam may update it again."""
        publish(self.saved, piece, step)
        self.progressed()

    def has_saved(self, piece: int, step: int) -> bool:
        """Whether the checkpoint writer has the piece's state after `step` on disk (no wait)."""
        return reached(self.saved, piece, piece + 1, step)

    def wait_saved(self, piece: int, step: int, what: str) -> None:
        """Adam, before updating a piece while the checkpoint of `step` is written: wait for the writer."""
        self._wait_reached(self.saved, slice(piece, piece + 1), step, what)

    def _wait_reached(self, counters: np.ndarray, span: slice, value: int, what: str) -> None:
        if reached(counters, span.start, span.stop, value):
            self.progressed()
            return
        cfg, nap = self.spec.ipc, NAP_MIN_S
        deadline = time.monotonic() + cfg.wait_timeout_s
        self._waiting(what, +1)
        try:
            while not reached(counters, span.start, span.stop, value):
                self.check_abort()  # one word of shared memory: cheap enough for every nap
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"waited {cfg.wait_timeout_s:g}s for {what}")
                time.sleep(nap)
                nap = min(nap * 2, NAP_MAX_S)
        finally:
            self._waiting(what, -1)


class _Heartbeat:
    """One thread per process writes the heartbeat of every role attached in it, once a second: a
    stopped or frozen process stops beating, which is how the monitor tells it from a busy one."""

    stores: weakref.WeakSet = weakref.WeakSet()
    lock = threading.Lock()
    thread: threading.Thread | None = None
    stopping = threading.Event()

    @classmethod
    def register(cls, store: Store) -> None:
        with cls.lock:
            cls.stores.add(store)
            if cls.thread is None or not cls.thread.is_alive():
                cls.thread = threading.Thread(target=cls._run, name="megatrain-heartbeat", daemon=True)
                cls.thread.start()

    @classmethod
    def _stop(cls) -> None:
        """At interpreter exit: the thread ends before the interpreter tears down the modules and mappings
        it writes through, instead of being cut off wherever it is."""
        cls.stopping.set()
        thread = cls.thread
        if thread is not None:
            thread.join(2 * BEAT_S)

    @classmethod
    def unregister(cls, store: Store) -> None:
        with cls.lock:
            cls.stores.discard(store)

    @classmethod
    def _run(cls) -> None:
        while not cls.stopping.is_set():
            with cls.lock:
                live = list(cls.stores)
            now = time.monotonic()
            for store in live:
                try:
                    store.role_words[store.slot, BEAT] = now
                except (ValueError, TypeError):  # unmapped
                    cls.unregister(store)
            del live
            cls.stopping.wait(BEAT_S)


atexit.register(_Heartbeat._stop)
