"""Store owner: creates the run's shared memory on the GPU's node, fills it, and unlinks it at the end.

The only process that creates or unlinks. It also starts the reaper, a watchdog that unlinks for it
if it is killed without running any code (SIGKILL from ray.kill or the OOM killer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from megatrain.actors.base import Role
from megatrain.actors.lifeline import Lifeline, raylet
from megatrain.config.engine import FIXED_SIZES
from megatrain.errors import AbortError, ConfigError, Origin, ProtocolError
from megatrain.formats import checkpoint as ckpt
from megatrain.host.hostmem import fault_in, ranges_without
from megatrain.ipc.cpus import ThreadRequest, cpu_plan, node_cores
from megatrain.ipc.messages import FillReport, HostMemory, StoreRequest
from megatrain.ipc.monitor import Monitor
from megatrain.ipc.procs import live, maps_path, running, spawn_detached, start_ticks
from megatrain.ipc.protocol import Store, StoreSpec, checkpoint_host_bytes, plan_store
from megatrain.ipc.protocol.checkpoints import restore
from megatrain.ipc.shared.segments import sweep
from megatrain.ipc.shared.shm import (
    HEADER_BYTES,
    check_space,
    mem_total_bytes,
    pss_split,
    ray_memory_threshold,
    remove_cuda_ipc_files,
    seg_name,
    space_now,
)
from megatrain.memory.host import REAPER, resolve_spares, spare_room
from megatrain.memory.machine import Machine
from megatrain.memory.plan import MemoryPlan
from megatrain.model.spec import ModelConfig, build_spec, family_classes, init_unit, meta_model, unit_seed
from megatrain.model.weights import checkpoint_index, copy_slots, fill_tile, read_unit, slot_views
from megatrain.roster import OWNER, Roster
from megatrain.step.engine import EngineConfig, fixed_sizes

STRAGGLER_S = 1.0  # how long workers get to exit after the driver's kill before they are ended by pid
LOADERS = 2  # units read from a pretrained checkpoint at once: one is read while the other is converted
PAGE_IN_THREADS = 8  # page faults are the kernel's work: half the cores leave step 1 theirs


class StoreOwner(Role):
    def __init__(self, name: str = OWNER, family: str = ""):
        """`family`: a fresh init's model family, whose modeling code (the init's) this process imports on a
        thread from now, while the launcher still reads the run's inputs and then while the segments are
        made; '' where the store is filled from files."""
        super().__init__(name)
        # On a thread: create() makes the segments meanwhile, and the fault-ahead pages them in.
        self.importing = threading.Thread(target=self._import, args=(family,), name="model-code", daemon=True)
        self.importing.start()
        self.reaper = 0  # pid of the reaper (not a child of this process: see megatrain.ipc.shared.reaper)
        self.done = threading.Event()
        self.monitor: Monitor | None = None
        self.filled: FillReport | None = None
        self.making = threading.Lock()  # held while segments are created, and by shutdown
        self.paging: threading.Thread | None = None  # pages in the zero planes (_page_in)
        self.paging_stop = threading.Event()
        self.space: tuple[int, int] | None = None  # shm free and MemAvailable before the store (create)
        self.memory: MemoryPlan | None = None  # the run's memory plan (create)
        self.lost: AbortError | None = None  # why this host's part of the run ended itself (its node was lost)
        node = raylet()  # a Ray worker's: its host's part of the run ends with its node (actors/lifeline.py)
        self.lifeline = Lifeline(node, self._node_lost).start() if node else None

    def _import(self, family: str) -> None:
        if family:
            family_classes(family)
            self.mark("model code")

    def serve(self) -> None:
        """Held open by the driver for the whole run: if this process dies, the call fails at once, and
        when the run is aborted (an actor failed, or the monitor found a stall) it raises the reason, which
        is how the driver learns of either while it waits on a step, even on an actor that never answers."""
        while not self.done.wait(0.1):
            if self.store is not None and self.store.aborted:
                raise self.store.abort_error()  # its origin and time with it (launch/control/failures.py)
        if self.lost is not None:  # the lifeline's shutdown set `done` first: the driver must still learn why
            raise self.lost

    def create(self, request: StoreRequest) -> StoreSpec:
        """Plan (in the staging mode of the request's memory plan, which the driver made before anything was
        spawned), create and fill the store: from the model config, or from checkpoint directory
        `request.resume` (weights and Adam state, versions at its step). The node's CPU plan is made here, on
        the node the workers share, and travels in the spec.
        While the engine has `auto` sizes the plan takes the fixed ones, and settle() gets the chosen ones."""
        shm_dir = request.ipc.shm_dir
        removed = sweep(shm_dir=shm_dir)
        if removed:
            print(f"[{self.name}] swept {len(removed)} objects left over in {shm_dir}", flush=True)
        self.space = space_now(shm_dir)  # settle() re-checks against the memory as it was before
        # The driver's spec: its structure is built once, and the modeling code this process imports for the
        # init comes after the segments, while their pages are faulted in (_make).
        self.model = request.spec if request.spec is not None else build_spec(request.model, request.no_decay_1d)
        self.memory = request.memory  # the driver's, made once before anything was spawned
        # the staging mode is the plan's: decided once, before the store; admission only re-checks it here
        self.request = dataclasses.replace(
            request, ipc=dataclasses.replace(request.ipc, staging=self.memory.staging_mode)
        )
        # The activation checkpoints the executor will pin depend on the engine's sizes; while some are still
        # `auto` they are unknown (the fixed sizes would count every block's, where the chosen ones may keep
        # them on the GPU), so the store is checked alone now and with them in settle().
        known = not any(getattr(request.engine, size) == "auto" for size in FIXED_SIZES)
        spec, ram_only = self._plan(fixed_sizes(self.request.engine), checkpoints=known)
        self._make(spec, ram_only)
        return spec

    def settle(self, engine: EngineConfig) -> StoreSpec:
        """The spec with the engine's chosen sizes. The checkpoint plan they fix orders the walk, not the
        memory; the pinned checkpoints they imply are admitted beside the store against the memory as it was
        before it, and a store they no longer leave room for is refused with the numbers."""
        spec, ram_only = self._plan(engine)
        check_space(spec.part_bytes(), spec.ipc.shm_dir, ram_only, self.space)
        spares = self._spares(spec, ram_only)
        if spares:
            spec = dataclasses.replace(spec, spares=spares)
            check_space(spec.part_bytes(), spec.ipc.shm_dir, ram_only, self.space)
            self.store.add_spares(spec)
        self.store.spec = spec
        return spec

    def _spares(self, spec: StoreSpec, ram_only: dict[str, int]) -> int:
        """ipc.spare_slots resolved against the memory as it was before the store: what the store, the pinned
        checkpoints and the processes leave (megatrain/memory/host.py resolve_spares), said in the log."""
        if self.store.spec.spares:  # settled before: its segments are made, with their sizes
            return self.store.spec.spares
        parts, (free, avail) = spec.part_bytes(), self.space
        shm_need = sum(parts.values()) + len(parts) * HEADER_BYTES
        machine = Machine(ram=avail, total=mem_total_bytes(), shm=free, threshold=ray_memory_threshold())
        room = spare_room(free, machine.limit, machine.total, shm_need, shm_need + sum(ram_only.values()))
        try:
            count, why = resolve_spares(
                self.request.ipc.spare_slots,
                spec.layout,
                spec.gpu_units,
                resident=spec.resident,
                clip=spec.clip,
                hosts=spec.hosts,
                room=room,
                staging_bytes=spec.staging_bytes,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        print(f"[{self.store.label(self.name)}] spare slots for speculative updates: {why}", flush=True)
        return count

    def node_machine(self, shm_dir: str = "/dev/shm") -> Machine:
        """This node's memory now, with Ray's memory-monitor threshold as its workers have it: the machine a
        store here is planned for."""
        free, avail = space_now(shm_dir)
        return Machine(ram=avail, total=mem_total_bytes(), shm=free, threshold=ray_memory_threshold())

    def _plan(self, engine: EngineConfig, checkpoints: bool = True) -> tuple[StoreSpec, dict[str, int]]:
        req, model = self.request, self.model
        pinned = checkpoint_host_bytes(model, engine, *req.batch_shape) if checkpoints else 0
        # what the run's processes take beside the store (megatrain/memory/host.py): kept free at admission
        reserve = self.memory.reserve
        ram_only = {"activation checkpoints (executor, pinned)": pinned, "processes, after the store": reserve}
        spec = plan_store(
            req.run_id,
            model,
            engine.compute_dtype,
            engine.checkpoint_interval,
            req.num_packers,
            req.num_accumulators,
            req.ipc,
            cuda=engine.device == "cuda",
            clip=req.clip,
            last_block_layers=engine.last_block_layers,
            executors=req.executors,
            hosts=req.hosts,
            host=req.host,
            gpu_units=engine.gpu_optimizer if isinstance(engine.gpu_optimizer, int) else 0,
        )
        ram_only["page tables of its mappings"] = spec.page_table_bytes()
        return self._with_cpu_plan(spec, engine.device == "cuda", req.threads), ram_only

    def _make(self, spec: StoreSpec, ram_only: dict[str, int]) -> None:
        """Create the segments (under the lock shutdown takes, so it never misses a store being made), then
        fill them."""
        with self.making:
            if self.done.is_set():
                raise AbortError("the run was shut down before its store was made")
            self.store = Store.create(spec, ram_only)
            self._start_reaper(spec.run_id)
        self.mark("segments")
        self.store.write_about(self.request.about)
        model_cfg, resume = self.request.model, self.request.resume
        t0 = time.perf_counter()
        if resume:
            source, nbytes = str(resume), self._restore(Path(resume))
        else:
            with self._faulting_ahead():
                source, nbytes = model_cfg.pretrained or "init", self._fill(model_cfg)
        self.filled = FillReport(source=source, bytes=nbytes, seconds=time.perf_counter() - t0)
        self.mark("filled")
        self.monitor = Monitor(self.store).start()

    @contextlib.contextmanager
    def _faulting_ahead(self) -> Iterator[None]:
        """The pages the fill writes (params, and the resident copy) faulted in by threads of their own from
        the start of the fill: its first part is this process's import of the family's modeling code (for
        the init) or the first unit's read, when no page would be touched otherwise. The bytes are left
        alone (the fill may already write them). Stopped at the fill's end (the rest is the fill's own)."""
        segments = self.store.segments
        whole = [np.frombuffer(segments[p].mm, np.uint8) for p in ("params", "resident") if p in segments]
        stop = threading.Event()
        ahead = threading.Thread(
            target=fault_in,
            args=([(a.ctypes.data, a.nbytes) for a in whole], PAGE_IN_THREADS, stop),
            name="fault-ahead",
            daemon=True,
        )
        ahead.start()
        try:
            yield
        finally:
            stop.set()
            ahead.join()

    def page_in(self) -> None:
        """Start paging in the planes the fill did not write (Adam's moments after a fresh init, the gradient
        plane), in the background, into the first step: their first writes otherwise fault in every 4 KiB
        page inside the first update (the first two steps took about twice as long as the rest). The driver
        calls it once the workers are attached: a host near its memory's end first-touches pages at about
        5 GiB/s in all, so beside the fill the page-in made the draw 46 % slower, and during the attach
        it slowed the executor's pinning from 1.3 to 7-9 s (7.6B, H200 host)."""
        if self.store is None or self.paging is not None:
            return
        self.paging_stop = threading.Event()
        self.paging = threading.Thread(
            target=self._page_in, args=(self.store, self.paging_stop), name="page-in", daemon=True
        )
        self.paging.start()

    def _page_in(self, store: Store, stop: threading.Event) -> None:
        """page_in()'s thread. It leaves the bytes alone (hostmem.populate): the steps may already write them."""
        parts = [p for p in ("exp_avg", "exp_avg_sq", "grads") if p in store.spec.planes]
        planes = [store.plane(part) for part in parts] + [store.region(p).numpy() for p in store.spec.spare_parts()]
        # not the tiles of the units the GPU holds: their state leaves the host once the executor has it
        held = [[store.tile(part, u) for u in store.spec.on_gpu] for part in parts]
        holes = held + [[]] * (len(planes) - len(held))
        ranges = [r for plane, tiles in zip(planes, holes, strict=True) for r in ranges_without(plane, tiles)]
        parts += store.spec.spare_parts()
        t0 = time.perf_counter()
        done, pieces = fault_in(ranges, PAGE_IN_THREADS, stop)
        me = store.label(self.name)  # over several hosts, with its host
        if pieces and done == pieces:
            print(
                f"[{me}] paged in {', '.join(parts)} ({sum(n for _, n in ranges) / 2**30:.1f} GiB) "
                f"in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        elif pieces and not done and not stop.is_set():
            print(
                f"[{me}] this kernel cannot page in ahead (madvise MADV_POPULATE_WRITE): the first "
                f"update faults {', '.join(parts)} in",
                flush=True,
            )

    def _with_cpu_plan(self, spec: StoreSpec, cuda: bool, request: ThreadRequest) -> StoreSpec:
        import numba

        cores = node_cores()
        plan = cpu_plan(cores, self._roster(spec), request, numba.config.NUMBA_NUM_THREADS)
        spec = dataclasses.replace(spec, threads=plan, cores=cores)
        self.apply_threads(spec)  # the fill (init, import, resume) runs on this process's threads
        return spec

    def _roster(self, spec: StoreSpec) -> Roster:
        """The run's roster, its memory plan's (the driver spawned its actors from the same), which must be for
        the store's staging mode."""
        roster = self.memory.roster
        if roster.staging != spec.staging_mode:
            raise ProtocolError(
                f"the store is planned for weight staging {spec.staging_mode}, the run's actors for {roster.staging}"
            )
        return roster

    def node_space(self, shm_dir: str) -> tuple[int, int]:
        """Free shared memory and MemAvailable on this node now: what the driver decides the staging mode
        against, where the memory decides it, before the workers are spawned (launch/run/startup.py)."""
        return space_now(shm_dir)

    def _node_lost(self, why: str) -> None:
        """The lifeline's verdict: abort this host's store (its workers stop; serve() gives the driver the reason,
        if it still listens), end its workers, unlink it, and exit: nothing of the run outlives the node's Ray."""
        if self.shared_process:  # the driver's own process (the in-process runner): not this role's to end
            return
        request = getattr(self, "request", None)  # the host it serves, once asked for a store
        reason = (f"host {request.host}: " if request is not None and request.hosts > 1 else "") + why
        print(f"[{self.name}] {reason}; ending this host's part of the run", flush=True)
        # a death, of the node's every process: the run's root cause, before what it brings about on other hosts
        self.lost = AbortError(f"run aborted: {reason}", Origin.DEATH, time.time())
        if self.store is not None:
            self.store.abort(reason, Origin.DEATH)
        try:
            self.shutdown()  # its workers first (they map the store), then every name of the store
        finally:
            os._exit(1)

    def _start_reaper(self, run_id: str) -> None:
        pid = os.getpid()
        self.reaper = spawn_detached("megatrain.ipc.shared.reaper", run_id, str(pid), str(start_ticks(pid)))

    def fill_report(self) -> FillReport:
        if self.filled is None:
            raise ProtocolError("fill_report() before create() completed: the store was not filled")
        return self.filled

    def _fill(self, cfg: ModelConfig) -> int:
        """The weights, unit by unit: read from model.pretrained (LOADERS units at a time; the bytes of its
        files are returned) or drawn fresh (in unit order, from one seed; 0 bytes read)."""
        spec = self.store.spec.model
        units = range(len(spec.layout.units))
        if not cfg.pretrained:
            self._draw(cfg.init_seed)
            return 0
        where = checkpoint_index(cfg.pretrained)
        with ThreadPoolExecutor(LOADERS, thread_name_prefix="load") as pool:
            for _ in pool.map(lambda u: self._fill_unit(u, read_unit(spec, u, where)), units):
                pass  # each unit's tensors are dropped once its tile holds them: about LOADERS units in RAM
        return sum(f.stat().st_size for f in set(where.values()))

    def _draw(self, seed: int) -> None:
        """A fresh init, drawn straight into the params plane by one thread per core of the plan (each unit
        from its own seed and generator, so the result does not depend on the thread count; a 7.6B model's
        normal draws take about 45 s on one core), each unit's resident copy cast by the thread that drew it.
        A family whose init draws outside torch's random ops (seen by the global generator moving) is drawn
        again unit by unit in order, with the global generator seeded too, so it is still deterministic."""
        spec = self.store.spec.model
        self.importing.join()  # an import the constructor started (a failed one fails meta_model's here)
        model = meta_model(spec.family, spec.hf_config)
        if "model code" not in self.marks:  # not imported ahead (the constructor's family)
            self.mark("model code")
        units = range(len(spec.layout.units))
        before = torch.random.get_rng_state()
        # Largest first (the embedding and the head are a few layers' worth each): no thread is left with a
        # big unit at the end. The draws do not depend on the order (each unit has its own generator).
        largest = sorted(units, key=lambda u: -spec.layout.structure_of(u).numel)
        with ThreadPoolExecutor(self.store.spec.threads[OWNER].torch, thread_name_prefix="init") as pool:
            for _ in pool.map(lambda u: self._draw_unit(model, u, seed), largest):
                pass
        if not torch.equal(before, torch.random.get_rng_state()):
            print(
                f"[{self.name}] the init of '{spec.family}' draws from the global generator: drawing again "
                "in unit order",
                flush=True,
            )
            for u in units:
                self.store.torch_tile("params", u).zero_()
                torch.manual_seed(unit_seed(seed, u))
                self._draw_unit(model, u, seed)
        self.mark("drawn")

    def _draw_unit(self, model: torch.nn.Module, unit: int, seed: int) -> None:
        self._check_going()
        spec = self.store.spec.model
        tile = self._whole_tile(unit)  # zero: the segments are created zeroed
        copy_slots(spec, unit, tile, init_unit(spec, model, unit, seed, into=slot_views(spec, unit, tile)))
        self._keep(unit, tile)

    def _fill_unit(self, unit: int, tensors: dict[str, torch.Tensor]) -> None:
        self._check_going()
        tile = self._whole_tile(unit)
        fill_tile(self.store.spec.model, unit, tile, tensors)
        self._keep(unit, tile)

    def _whole_tile(self, unit: int) -> torch.Tensor:
        """Where a unit's weights are drawn or read whole: its params tile, or over several hosts (the params
        plane holds this host's slice) a buffer of the whole unit, every host drawing the same weights."""
        if self.store.spec.hosts == 1:
            return self.store.torch_tile("params", unit)
        return torch.zeros(self.store.spec.layout.structure_of(unit).numel, dtype=torch.float32)

    def _keep(self, unit: int, tile: torch.Tensor) -> None:
        """The unit's weights, drawn or read whole into `tile`, into the store: this host's slice of them in
        the params plane, and the whole unit into the resident copy its executors stream from."""
        store = self.store
        if store.spec.hosts > 1:
            lo, hi = store.spec.owned(unit)
            store.torch_tile("params", unit).copy_(tile[lo:hi])
            store.resident_tile(unit).copy_(tile)  # torch's cast, as refresh_resident's
        elif store.spec.resident:
            store.refresh_resident(unit)

    def params_slice(self, unit: int, start: int = 0, count: int | None = None) -> torch.Tensor:
        """A copy of elements [start, start + count) of this host's slice of the unit's fp32 master weights
        (one host: the unit whole), cut at the slice's end: the final save exports the weights unit by unit,
        gathered chunk by chunk from every host's slice (launch/run/checkpoints.py)."""
        tile = self.store.tile("params", unit)
        return torch.from_numpy(tile[start : None if count is None else start + count].copy())

    def _check_going(self) -> None:
        """A fill stops at the next unit (a resume: plane) once the run is shut down (it runs beside the
        executor's start)."""
        if self.done.is_set():
            raise AbortError("the run was shut down while its store was being filled")

    def _restore(self, directory: Path) -> int:
        """The state after the checkpoint's step: every plane read back (CRC-checked), the version counters
        at that step (its updates are applied), the resident copy rewritten. A checkpoint written on another
        host count is sliced again for this one (ipc/protocol/checkpoints.py restore)."""
        manifest = ckpt.manifest_of(directory)
        if manifest is None:
            raise ConfigError(f"train.resume: {directory} is not a complete checkpoint")
        return restore(self.store, directory, manifest, self._check_going)

    @staticmethod
    def _end_stragglers(pids: list[int], segment: str) -> None:
        """Workers the driver's kill has not ended (a frozen process, SIGSTOPped or stuck in the kernel,
        ignores Ray's kill until Ray's own timeout): SIGKILL them by pid, once they are proven to be this
        run's (they map its segments), so that no process of the run outlives it."""
        deadline = time.monotonic() + STRAGGLER_S
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in pids:
            if running(pid) and maps_path(pid, segment):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def host_memory(self) -> HostMemory:
        """Host memory of the run's processes on this node, as PSS: the owner, its reaper and every worker
        recorded in ctl (the shared store counted once, split among the processes that map it), in all
        and per role outside the store (what each process costs beyond the shared segments; roles
        sharing a process, as in the in-process runner, are named together)."""
        named = {os.getpid(): [self.name], **({self.reaper: [REAPER]} if self.reaper else {})}
        for slot, role in enumerate(self.store.spec.roles()):
            pid = int(self.store.pids[slot])
            if pid > 0:
                named.setdefault(pid, []).append(role)
        store = seg_name(self.store.spec.run_id, "")
        pss = {"+".join(roles): pss_split(pid, store) for pid, roles in named.items()}
        return HostMemory(
            processes=len(named),
            pss_bytes=sum(total for total, _ in pss.values()),
            pss_own_by_role={role: own for role, (_, own) in pss.items()},
        )

    def shutdown(self) -> None:
        """Unlink every name of the run (idempotent); processes still attached keep their mappings.

        The driver kills the workers first; what the CUDA driver left for them goes once they are dead.
        """
        self.done.set()
        if self.lifeline is not None and threading.current_thread() is not self.lifeline.thread:
            self.lifeline.stop()  # a shutdown the driver asked for: the node may go now
        with self.making:  # a store being created is released too; none is created after this
            self._release()

    def _release(self) -> None:
        if self.paging is not None:
            self.paging_stop.set()
            self.paging.join()
            self.paging = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        if self.store is not None:
            workers = [int(p) for p in self.store.pids if p > 0 and p != os.getpid()]
            # Stragglers first: the CUDA files wait for every worker's death, which Ray's own kill takes 5 s to
            # bring to a frozen one (a stall verdict's), so the run's end would trail the verdict by that much.
            self._end_stragglers(workers, seg_name(self.store.spec.run_id, ""))
            remove_cuda_ipc_files([int(p) for p in self.store.pids if p > 0], self.store.spec.ipc.shm_dir)
            self.store.unlink()
        if self.reaper:
            deadline = time.monotonic() + 5
            # It exits once the ctl segment is gone. A zombie counts as gone: it has run its last code, and where the
            # first process is no init (a container's) the reaping that ends it comes a second or two later, or never.
            while live(self.reaper) and time.monotonic() < deadline:
                time.sleep(0.05)
            if live(self.reaper):
                os.kill(self.reaper, signal.SIGKILL)
            self.reaper = 0
