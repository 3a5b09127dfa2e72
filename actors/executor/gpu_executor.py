"""GPU executor: runs the whole step's layer loop, streaming weights in from and gradients out to shm.

Without a GPU the same engine runs on the CPU device with the synchronous source and sink: same
slabs, same semaphores, same order (actors/executor/streams.py, over the verbs of ipc/protocol/executor.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from megatrain import steptime
from megatrain.actors.base import Role, guarded
from megatrain.actors.executor.gpustate import STATE, GpuState
from megatrain.actors.executor.reduce import HostScatter, StreamedReducingSink, SyncReducingSink
from megatrain.actors.executor.streams import Marks, StreamedSink, StreamedSource, SyncSink, SyncSource, copy_intervals
from megatrain.collective import Group, World, connect_rendezvous, join_world, open_rendezvous
from megatrain.config.optim import OptimConfig
from megatrain.daemons import DaemonExecutor
from megatrain.errors import MegatrainError, ProtocolError, ResourceError
from megatrain.host.cudahost import use_expandable_segments
from megatrain.ipc.messages import EvalRequest, EvalSums, GenerateRequest, StepReport, StepRequest
from megatrain.ipc.protocol import Store, StoreSpec
from megatrain.memory.budget import GpuCap, budget_bytes, cap_device, peak_bytes, sizes_of
from megatrain.memory.host import SPARE_RESIDENT
from megatrain.model.spec import ModelSpec, family_classes
from megatrain.roster import Kind, role_name
from megatrain.step.engine import EngineConfig, StepEngine, resolve_device, resolve_dtype
from megatrain.step.profiling import StepProfile
from megatrain.step.warmup import warm_up


class GpuExecutor(Role):
    def __init__(self, cfg: EngineConfig, family: str = "", rank: int = 0, gpu: int | None = None):
        """Process-level set-up, done while the store owner makes the store: the CUDA context, and the
        modeling code of the model's family (the engine's templates come from it). `rank`: this executor's
        place among its host's executors (actors.num_gpus), one GPU each; `gpu`: the GPU it takes among those
        its process sees, where not `rank` (hosts simulated in one process share its GPUs)."""
        super().__init__(role_name(Kind.EXECUTOR, rank))
        self.cfg, self.rank = cfg, rank
        self.group: Group | None = None  # the engine's: the step's statistics over every executor of the run
        self.world: World | None = None  # a run of several executors: every group this executor is in
        self.rendezvous = None  # host 0's executor 0's, while the groups form
        if cfg.device != "cpu" and torch.cuda.is_available():  # before anything initializes CUDA
            print(f"[{self.name}] {use_expandable_segments()}", flush=True)
        self.device = resolve_device(cfg, rank if gpu is None else gpu)
        self.cuda = self.device.type == "cuda"
        self.cap: GpuCap | None = None  # engine.gpu_memory_gib (megatrain/memory/budget.py)
        self.planned: int | None = None  # the plan's GPU peak at the sizes chosen
        if self.cuda:
            torch.cuda.set_device(self.device)
            torch.cuda.init()
            self.cap = cap_device(self.device, budget_bytes(cfg))  # before anything is allocated
            if self.cap:
                print(f"[{self.name}] {self.cap}", flush=True)
            self.mark("cuda")
        if family:
            family_classes(family)  # imports the family's modeling module
            self.mark("model code")
        # Every step runs on this one thread, whichever of the actor's threads takes the call: cuBLAS and
        # cuDNN handles (and cuBLAS workspaces) are per thread, and creating them inside a step put
        # cudaFree calls in the layer loop (found by the profiled step). The warm-up runs on it too.
        # The initializer must not hold self: the pool's thread would keep the executor (its pinned and
        # GPU memory) alive after the actor is dropped in the in-process runner.
        init = functools.partial(torch.cuda.set_device, self.device) if self.cuda else None  # per thread
        self.compute = DaemonExecutor("compute", initializer=init)  # a stuck step never holds the exit
        self.mark("ready")

    def warm_up(self, model: ModelSpec, cfg: EngineConfig, batch: int, seq: int) -> None:
        """Start the warm-up (megatrain/step/warmup.py) on the compute thread with the chosen engine sizes, while
        the store is filled; returns at once. The first step queues behind it on that thread."""
        if self.cuda:
            if self.cap:  # named by an OOM under the budget only
                self.planned = peak_bytes(model, cfg, batch, seq, sizes_of(cfg))
            self.compute.submit(self._warm_up, model, cfg, batch, seq)

    def _warm_up(self, model: ModelSpec, cfg: EngineConfig, batch: int, seq: int) -> None:
        t0 = time.perf_counter()
        try:
            warm_up(
                StepEngine(model, cfg, self.device, resolve_dtype(cfg, self.device)), cfg.chunk_sequences or batch, seq
            )
            self.mark("warm")
        except Exception as exc:  # out of memory included: a diagnostic only, the step says what fails
            print(
                f"[{self.name}] warm-up skipped after {time.perf_counter() - t0:.1f} s: {type(exc).__name__}: {exc}",
                flush=True,
            )

    def gpu_free_bytes(self) -> int:
        """Free GPU memory now, after this process's CUDA context: what autosize.py may plan with."""
        return int(torch.cuda.mem_get_info(self.device)[0])

    def gpu_room(self) -> tuple[int, int | None]:
        """(free GPU memory now, after this process's CUDA context; what engine.gpu_memory_gib leaves the
        caching allocator, None without a budget): the sizes are planned for the smaller."""
        return self.gpu_free_bytes(), (self.cap.room if self.cap else None)

    def step_rate(self, hidden: int, inner: int, tokens: int) -> steptime.Rate | None:
        """The rate of a step's FLOPs on this executor's device (megatrain/steptime.py): a GPU's by its name,
        the CPU's a matmul of the model's shape timed with this process's threads; None for a GPU without one."""
        dtype = resolve_dtype(self.cfg, self.device)
        if self.cuda:
            return steptime.device_gpu_rate(self.device) if dtype == torch.bfloat16 else None
        return steptime.cpu_rate(hidden, inner, tokens, dtype, torch.get_num_threads())

    def attach(self, spec: StoreSpec, cfg: EngineConfig | None = None, optim: OptimConfig | None = None) -> None:
        """`cfg`: the engine config with its `auto` sizes resolved (the driver chose them after this
        process started); `optim`: the optimizer's settings, for the units whose optimizer the device holds
        (spec.gpu_units: required then)."""
        self.apply_threads(spec)
        self.cfg = cfg = cfg or self.cfg
        # the staging slabs, or the resident copy with its spare slots' (ipc.spare_slots), which it pins
        parts = ("staging", "resident", *spec.spare_parts(SPARE_RESIDENT)) if spec.resident else ("staging",)
        held = STATE if spec.gpu_units else ()  # the planes its device's units are loaded from and written back to
        self.store = Store.attach(spec, parts + held, role=self.name)
        dtype = resolve_dtype(cfg, self.device)
        self.engine = StepEngine(spec.model, cfg, self.device, dtype)
        self.handles: list[bytes] | None = None
        if self.cuda:
            from megatrain.ipc.cuda_events import make_ipc_events, pin_while_alive

            pinned = [self.store.region(part) for part in parts]
            pin_while_alive(self, pinned, self.device)
            self.mark("pinned")
            # the gradient slabs' events, for the processes that drain them (none: gradients into the copy)
            events, self.handles = make_ipc_events(spec.num_grad_slabs) if spec.num_grad_slabs else ([], None)
            self.source = StreamedSource(self.store, self.device, dtype, cfg.prefetch)
            self.sink = StreamedSink(self.store, self.device, events, self._fetched)
        else:
            self.source = SyncSource(self.store, self.device, dtype)
            self.sink = SyncSink(self.store, self._fetched)
        self.gpu_state: GpuState | None = None
        if spec.gpu_units:
            if optim is None:
                raise ProtocolError(
                    f"engine.gpu_optimizer {spec.gpu_units}: the executor attaches with the optim settings"
                )
            self.gpu_state = GpuState(self.store, self.device, dtype, optim, self.rank)
        self.source.gpu_state = self.sink.gpu_state = self.gpu_state
        self.mark("attached")

    def open_world(self, size: int, address: str) -> int:
        """The run's first executor (host 0's executor 0): the rendezvous of every executor of every host
        (`size` of them), reachable at `address` (loopback on one host; over several, this node's address as the
        other hosts reach it); returns its port."""
        spec = self.store.spec
        if spec.host != 0 or self.rank != 0:
            raise MegatrainError(
                f"{self.name} of host {spec.host} opened the run's rendezvous: host 0's executor 0 does"
            )
        if size != spec.hosts * spec.num_executors:
            raise MegatrainError(
                f"a rendezvous for {size} executors; the run has {spec.hosts} hosts x {spec.num_executors} executors"
            )
        self.rendezvous = open_rendezvous(size, spec.ipc.wait_timeout_s, host=address)
        return int(self.rendezvous.port)

    def join_world(self, address: str, port: int, bind: str | None = None) -> str:
        """Join the run's groups, one host or several (every executor of every host at once; megatrain/
        collective.py join_world): the step's statistics over all of them; each gradient summed over this host's
        executors into its executor 0, which over several hosts reduce-scatters it among the hosts and lands
        only its own slice. Global rank: host x executors per host + this executor's. `bind`: this node's
        address as the other hosts reach it (for gloo's connections, megatrain/collective.py gloo_options)."""
        spec = self.store.spec
        timeout_s, size = spec.ipc.wait_timeout_s, spec.hosts * spec.num_executors
        if spec.host == 0 and self.rank == 0:
            if self.rendezvous is None:
                raise MegatrainError(f"{self.name} joins the run's groups through its own rendezvous: open_world first")
            rendezvous = self.rendezvous
        else:
            rendezvous = connect_rendezvous(address, port, size, timeout_s)
        self.world = join_world(
            rendezvous,
            host=spec.host,
            hosts=spec.hosts,
            rank=self.rank,
            per_host=spec.num_executors,
            device=self.device,
            timeout_s=timeout_s,
            check=self.store.check_abort,
            bind=bind,
        )
        scatter = HostScatter(spec, self.world.hosts) if self.world.hosts is not None else None
        return self._reduce_through(self.world.stats, self.world.local, scatter)

    def _reduce_through(self, stats: Group, local: Group | None, hosts: HostScatter | None) -> str:
        """From now on the engine's statistics are summed over `stats`, each gradient over `local` (this
        host's executors) into executor 0 and by it over `hosts`; only executor 0's reaches the store.
        Returns once every member of `stats` is there."""
        self.group = self.engine.group = stats
        inner = self.sink if self.rank == 0 else None
        held = self.gpu_state
        if self.cuda:
            self.sink = StreamedReducingSink(self.store, local, self.device, inner, hosts, held, self.rank)
            self._on_compute(self.sink.warm)
        else:
            self.sink = SyncReducingSink(self.store, local, inner, hosts, held, self.rank)
        self._on_compute(stats.barrier)
        return stats.backend

    def _fetched(self) -> int:
        """Fetches the engine has taken so far in this step's weight walk (the sink's safety check)."""
        return self.source.walk.i

    @guarded
    def flush(self, step: int | None = None) -> int:
        """Write the state of the units the device holds back into the store's planes (bytes written; 0 with
        none held): `step`, before the checkpoint of the state after `step` steps (the writer takes those pieces
        at that version); None, before the final weights are read from the store."""
        if self.gpu_state is None:
            return 0
        return self._on_compute(self.gpu_state.flush, step)

    def event_handles(self) -> list[bytes] | None:
        return self.handles

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu"

    @guarded
    def step(self, request: StepRequest) -> StepReport:
        """One step of the request's rows; under a profile (a path) the step runs under torch.profiler and
        is checked for host-blocking calls in the layer loop."""
        r = request
        run = functools.partial(self._profiled, r.profile) if r.profile else self._step
        return self._on_compute(run, r.step, r.ids, r.labels, r.timeline, r.positions, r.lr)

    @guarded
    def evaluate(self, request: EvalRequest) -> EvalSums:
        """The request's forward-only passes: the summed token loss and the labelled tokens over its batches."""
        return self._on_compute(self._evaluate, request.step, request.batches)

    @guarded
    def generate(self, request: GenerateRequest) -> torch.Tensor:
        """The request's greedy decoding (the packers pack exactly as many walks): each row's right padding is
        overwritten as it grows; the new tokens, one column each."""
        r = request
        return self._on_compute(self._generate, r.step, r.ids, r.pos, r.new_tokens)

    def _on_compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run on the compute thread; the caller returns on an abort even if that thread never does (its
        own waits are timed; a hang in its own work is the stall monitor's to name)."""
        fut = self.compute.submit(fn, *args)
        while True:
            try:
                return fut.result(timeout=self.store.spec.ipc.poll_s)
            except FutureTimeout:
                self.store.check_abort()
            except torch.cuda.OutOfMemoryError as exc:  # under a budget: the budget and the plan named
                if self.cap is None:
                    raise
                raise ResourceError(self.cap.oom(exc, self.planned)) from None

    def _walks(self, step: int, count: int, fn: Callable[[], Any]) -> list:
        self._load_held(step)
        out = []
        for _ in range(count):
            self.source.begin(step, "forward")
            out.append(fn())
            self.source.end()
        return out

    def _evaluate(self, step: int, batches: list[tuple[torch.Tensor, ...]]) -> EvalSums:
        t0 = time.perf_counter()
        it = iter(batches)

        def one() -> tuple[torch.Tensor, torch.Tensor]:
            ids, labels, *positions = next(it)
            return self.engine.evaluate(ids, labels, self.source, positions[0] if positions else None)

        res = self._walks(step, len(batches), one)
        loss = sum(float(r[0]) for r in res)
        return EvalSums(loss_sum=loss, tokens=sum(int(r[1]) for r in res), eval_s=time.perf_counter() - t0)

    def _generate(self, step: int, ids: torch.Tensor, pos: torch.Tensor, new_tokens: int) -> torch.Tensor:
        ids, pos = ids.clone(), pos.clone()
        rows = torch.arange(ids.shape[0])
        out = torch.empty((ids.shape[0], new_tokens), dtype=torch.long)
        for k in range(new_tokens):
            nxt = self._walks(step, 1, functools.partial(self.engine.predict, ids, pos.clone(), self.source))[0].cpu()
            out[:, k] = nxt
            pos += 1
            ids[rows, pos.clamp(max=ids.shape[1] - 1)] = nxt
        return out

    def _profiled(
        self,
        path: str,
        step: int,
        ids: torch.Tensor,
        labels: torch.Tensor,
        timeline: bool,
        positions: torch.Tensor | None,
        lr: float,
    ) -> StepReport:
        # Started on the compute thread: torch.profiler records the CPU ops of the thread that starts it.
        with StepProfile(path, self.cuda) as prof:
            out = self._step(step, ids, labels, timeline, positions, lr, prof)
        try:
            found = prof.result()
        except (OSError, ValueError) as exc:  # a failed diagnostic does not stop the training run
            found = {"profile_trace": path, "profile_error": f"{type(exc).__name__}: {exc}"}
        return dataclasses.replace(out, profile=found)

    def _step(
        self,
        step: int,
        ids: torch.Tensor,
        labels: torch.Tensor,
        timeline: bool,
        positions: torch.Tensor | None = None,
        lr: float = 0.0,
        prof: StepProfile | None = None,
    ) -> StepReport:
        self._load_held(step)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if timeline and self.cuda:
            torch.cuda.synchronize(self.device)  # so that wall0 is when the first mark executes
        wall0 = time.time()
        marks = Marks(self.device)
        t0 = time.perf_counter()
        self.source.begin(step)
        self.sink.begin()
        try:
            with prof.loop() if prof else contextlib.nullcontext():
                res = self.engine.step(ids, labels, self.source, self.sink, marks, positions)
        finally:
            marks.close()
        loss, tokens = float(res.loss), int(res.tokens)  # the one host sync of the step
        self.sink.end()
        self.source.end()
        held = self._update_held(step, lr)
        routers = res.routers  # mixture of experts (megatrain/layers/moe.py)
        return StepReport(
            loss=loss,
            tokens=tokens,
            compute_s=time.perf_counter() - t0,
            weight_wait_s=self.source.wait_s,
            grad_wait_s=self.sink.wait_s,
            h2d_bytes=self.source.bytes,
            d2h_bytes=self.sink.bytes,
            **self._phases(marks),
            aux_loss=None if routers is None else float(routers.aux_loss()),
            expert_load=None if routers is None else routers.load(),
            gpu_peak_bytes=torch.cuda.max_memory_allocated(self.device) if self.cuda else None,
            **held,
            timeline={"wall0": wall0, **self._timeline(marks)} if timeline else None,
        )

    def _update_held(self, step: int, lr: float) -> dict:
        """The units the device holds, updated once Adam has the step's norm (every gradient is in: the sink
        has ended); their report fields (none without such units)."""
        if self.gpu_state is None:
            return {}
        t0 = time.perf_counter()
        norm, scale = self.store.wait_verdict(step)
        units = self.gpu_state.update(step, lr, norm, scale, self._held_group())
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the update's time, not its launch's
        return {"gpu_units": units, "gpu_update_s": time.perf_counter() - t0}

    def _load_held(self, step: int) -> None:
        """The held units' state onto the device before the first walk; the host's pages of it given back."""
        held = self.gpu_state
        if held is None or held.loaded:
            return
        held.load(step)
        if held.released:
            units = len(held.mine)
            print(
                f"[{self.name}] {units} units' optimizer on the GPU: {held.released / 2**30:.2f} GiB of the host's "
                "state planes given back (written back for checkpoints only)",
                flush=True,
            )

    def _held_group(self) -> Group | None:
        """The group the held units' weights go to every executor over: the run's (None: one executor alone)."""
        spec = self.store.spec
        return self.group if spec.num_executors * spec.hosts > 1 else None

    @staticmethod
    def _phases(marks: Marks) -> dict:
        """Seconds per phase: each interval between marks counts for the phase of the mark opening it
        (the last block's forward, head and backward interleave, chunk by chunk)."""
        out = {"forward_s": 0.0, "head_s": 0.0, "backward_s": 0.0}
        at = marks.seconds()
        for (name, t0), (_, t1) in zip(at, at[1:]):
            kind = name.split(":")[0]
            phase = "forward_s" if kind in ("forward", "fwd") else "head_s" if kind == "head" else "backward_s"
            out[phase] += t1 - t0
        return out

    def _timeline(self, marks: Marks) -> dict:
        """Per-unit lanes for the timeline picture: compute marks, H2D and D2H copy intervals."""
        out: dict = {"compute": marks.seconds()}
        if self.cuda:
            origin = marks.marks[0][1]
            out["h2d"] = copy_intervals(self.source.timeline, origin)
            out["d2h"] = copy_intervals(self.sink.timeline, origin)
        return out
