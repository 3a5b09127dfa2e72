"""The executor's weight sources and gradient sinks over the staging slabs (the hand-offs themselves are the
protocol's verbs, ipc/protocol/executor.py).

On the CPU device they are synchronous. On CUDA they use three streams, ordered only by events:
  H2D   a loader thread waits for filled weight slabs (host semaphores) and copies up to
        `prefetch` units ahead into fresh device buffers, recording a weights-ready event;
  compute  waits on weights-ready (a GPU-side wait) and never on the host, except when the
        loader has fallen behind (then it is the loader that is slow, and the wait is measured);
  D2H   a drain thread waits for free gradient slabs and copies each finished gradient out after
        the compute stream's backward-done event, then records the slab's interprocess event.
The compute thread thus issues kernels back to back while the threads do the host-side waiting.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from megatrain.actors.executor.gpustate import GpuState
from megatrain.actors.executor.threads import STOP, Worker
from megatrain.errors import ProtocolError
from megatrain.ipc.protocol import STAGING, Store
from megatrain.ipc.protocol.executor import (
    Walk,
    check_resident_write,
    free_grad_slab,
    grad_sent,
    grads_landed,
    weights,
)
from megatrain.ipc.protocol.plan import Item
from megatrain.step.profiling import NvtxPhases


class SyncSource:
    """CPU device: fetch j of the step reads each piece of the unit from its slab (then frees it) or from
    its resident tile. `blocks` is the plan's checkpoint blocks: the engine recomputes these."""

    def __init__(self, store: Store, device: torch.device, dtype: torch.dtype):
        self.store, self.device, self.dtype = store, device, dtype
        self.blocks = store.spec.blocks
        self.gpu_state: GpuState | None = None  # the units whose weights the device holds (gpustate.py)
        SyncSource.begin(self, 0)  # not the streamed override: no loader before a step

    def begin(self, step: int, walk: str = "step") -> None:
        """Start a walk ('step' or 'forward') over the weights after step-1's update."""
        self.step, self.wait_s, self.bytes = step, 0.0, 0
        self.walk = Walk(*self.store.spec.walk(walk), "fetched")

    def end(self) -> None:
        pass

    def acquire(self, item: Item) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Wait until the piece's weights are readable on the host; (host tensor, release or None when
        nothing is to be freed: a resident tile changes only after the unit's last use in the step)."""
        return weights(self.store, item, self.step)

    def _buffer(self, unit: int) -> torch.Tensor:
        n = self.store.spec.layout.structure_of(unit).numel
        self.bytes += n * self.dtype.itemsize
        return torch.empty(n, dtype=self.dtype, device=self.device)

    def held(self, unit: int) -> torch.Tensor | None:
        """The unit's weights where the device holds them (the walk moves on past it), else None."""
        if self.gpu_state is None or unit not in self.gpu_state.units:
            return None
        self.walk.next(unit)
        return self.gpu_state.weights(unit)

    def fetch(self, unit: int) -> torch.Tensor:
        if (held := self.held(unit)) is not None:
            return held
        out = self._buffer(unit)
        for item in self.walk.next(unit):
            t0 = time.perf_counter()
            host, release = self.acquire(item)
            self.wait_s += time.perf_counter() - t0
            out[item.lo : item.hi].copy_(host)
            if release is not None:
                release()
        return out


class SyncSink:
    """CPU device: each piece of gradient k of the step goes to its gradient slab as fp32 or, with
    grads_in_resident, into the unit's resident tile with its squared norm (see `in_resident`).

    `fetched` tells how far the engine's weight walk is (fetches taken so far): a gradient may overwrite
    its unit's resident tile only once the unit's last fetch of the step is behind it."""

    def __init__(self, store: Store, fetched: Callable[[], int] | None = None):
        self.store, self.fetched = store, fetched
        self.gpu_state: GpuState | None = None  # the units whose gradient stays on the device (gpustate.py)
        SyncSink.begin(self)  # not the streamed override: no drain thread before a step

    def begin(self) -> None:
        self.wait_s, self.bytes = 0.0, 0
        self.walk = Walk(self.store.spec.grad_order, self.store.spec.emit_items, "emitted")

    def end(self) -> None:
        pass

    def in_resident(self, unit: int, grad: torch.Tensor) -> tuple[torch.Tensor, list[Item]]:
        """The gradient in the resident copy's dtype, once the unit's weights are no longer needed; raises
        if the engine could still fetch them (the gradient would overwrite weights yet to be read)."""
        spec = self.store.spec
        check_resident_write(self.store, unit, self.fetched() if self.fetched is not None else len(spec.fetch_order))
        items = self.walk.next(unit)
        return grad.detach().to(STAGING[spec.staging_dtype][0]), items

    def kept(self, unit: int) -> bool:
        """Whether the unit's gradient stays on the device, for its update there."""
        return self.gpu_state is not None and unit in self.gpu_state.units

    def emit(self, unit: int, grad: torch.Tensor) -> None:
        if self.store.spec.grads_in_resident:
            grad, items = self.in_resident(unit, grad)
            if self.kept(unit):  # its norm to Adam as any unit's; the gradient stays
                grads_landed(self.store, items, [_sqnorm(grad[it.lo : it.hi]) for it in items])
                self.gpu_state.keep(unit, grad)
                return
            tile = self.store.resident_tile(unit)
            for item in items:
                piece = grad[item.lo : item.hi]
                sqnorm = _sqnorm(piece)
                tile[item.lo : item.hi].copy_(piece)
                grads_landed(self.store, [item], [sqnorm])
            self.bytes += grad.numel() * grad.element_size()
            return
        for item in self.walk.next(unit):
            t0 = time.perf_counter()
            slab = free_grad_slab(self.store, item)
            self.wait_s += time.perf_counter() - t0
            slab.copy_(grad.detach()[item.lo : item.hi])
            grad_sent(self.store, item)
        self.bytes += grad.numel() * 4


def _sqnorm(piece: torch.Tensor) -> float:
    """A piece's squared norm on the CPU device, as Adam sums it."""
    return float(piece.double().square().sum())


class StreamedSource(SyncSource):
    def __init__(self, store: Store, device: torch.device, dtype: torch.dtype, prefetch: int):
        super().__init__(store, device, dtype)
        # prefetch 0 is the no-double-buffering ablation: copies go on the compute stream itself, so
        # no transfer ever overlaps a kernel.
        self.h2d = torch.cuda.Stream(device) if prefetch > 0 else torch.cuda.default_stream(device)
        self.prefetch = max(prefetch, 1)
        self.ready: queue.Queue = queue.Queue()
        self.worker = Worker(store, "h2d-loader")
        self.credits = threading.Semaphore(self.prefetch)
        self.timeline: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self, step: int, walk: str = "step") -> None:
        super().begin(step, walk)
        self.credits = threading.Semaphore(self.prefetch)
        self.ready = queue.Queue()
        self.timeline = []
        self.worker.start(self._load)

    def end(self) -> None:
        self.worker.join()

    def _load(self) -> None:
        try:
            for items in self.walk.items:
                unit = items[0].unit
                if self.gpu_state is not None and unit in self.gpu_state.units:
                    continue  # served from the device (fetch)
                self.worker.acquire(self.credits, f"the engine to take a unit before loading unit {unit}")
                with torch.cuda.stream(self.h2d):
                    out = self._buffer(unit)
                with torch.cuda.nvtx.range(f"h2d:{unit}"):
                    self._load_unit(unit, items, out)
        finally:
            self.ready.put(STOP)

    def _load_unit(self, unit: int, items: list, out: torch.Tensor) -> None:
        for item in items:
            host, release = self.acquire(item)
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.h2d):
                start.record(self.h2d)
                out[item.lo : item.hi].copy_(host, non_blocking=True)
                done.record(self.h2d)
            self.timeline.append((unit, start, done))
            if item is items[-1]:
                self.ready.put((unit, out, done))  # copies on one stream: the last done covers all
            if release is not None:
                done.synchronize()  # a slab may be refilled once this copy has read it
                release()

    def fetch(self, unit: int) -> torch.Tensor:
        if (held := self.held(unit)) is not None:
            return held
        self.walk.next(unit)  # the loader thread walks the same items
        t0 = time.perf_counter()
        got, out, ready = self.worker.take(self.ready, f"weights of unit {unit}")
        self.wait_s += time.perf_counter() - t0
        if got != unit:
            raise ProtocolError(f"the H2D loader delivered unit {got} where the engine fetched unit {unit}")
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)
        out.record_stream(compute)
        self.credits.release()
        return out


class StreamedSink(SyncSink):
    def __init__(self, store: Store, device: torch.device, ipc_events: list, fetched: Callable[[], int] | None = None):
        super().__init__(store, fetched)
        self.device, self.ipc_events = device, ipc_events
        self.d2h = torch.cuda.Stream(device)
        self.worker = Worker(store, "d2h-drain")
        self.todo: queue.Queue = queue.Queue()
        self.credits = threading.Semaphore(store.spec.ipc.grad_slabs)
        self.timeline: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        # grads_in_resident: the pieces' squared norms land here (pinned once: pinning per step would
        # synchronize the device) before they go to ctl
        self.norms = (
            torch.zeros(store.spec.num_pieces, dtype=torch.float64, pin_memory=True)
            if store.spec.grads_in_resident
            else None
        )

    def begin(self) -> None:
        super().begin()
        self.todo = queue.Queue()
        self.credits = threading.Semaphore(self.store.spec.ipc.grad_slabs)
        self.timeline = []
        self.worker.start(self._drain)

    def end(self) -> None:
        self.worker.join()
        self.d2h.synchronize()

    def emit(self, unit: int, grad: torch.Tensor) -> None:
        norms = None
        if self.store.spec.grads_in_resident:
            grad, items = self.in_resident(unit, grad)  # the drain thread walks the same items
            # each piece's norm of the values Adam will read, in fp32 on the device, squared in fp64; over
            # several hosts only this host's pieces, none where it holds none of the unit
            parts = [torch.linalg.vector_norm(grad[it.lo : it.hi], dtype=torch.float32) for it in items]
            norms = torch.stack(parts).double().square() if parts else grad.new_zeros(0, dtype=torch.float64)
            sent = sum(it.hi - it.lo for it in items) * grad.element_size()
            if self.kept(unit):  # only its norms leave: the gradient stays for the update on the device
                self.gpu_state.keep(unit, grad)
                grad, sent = None, 0
        else:
            self.walk.next(unit)  # the drain thread walks the same items
            grad = grad.detach().float()
            sent = grad.numel() * grad.element_size()
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        t0 = time.perf_counter()
        self.worker.acquire(self.credits, f"a gradient credit for unit {unit}")  # at most G queued on the GPU
        self.wait_s += time.perf_counter() - t0
        self.bytes += sent
        self.todo.put((unit, grad, norms, done))

    def _drain(self) -> None:
        for k, items in enumerate(self.store.spec.emit_items):
            unit, grad, norms, done = self.worker.take(self.todo, f"the gradient of item {k}")
            self.d2h.wait_event(done)
            with torch.cuda.nvtx.range(f"d2h:{unit}"):
                if norms is None:
                    self._copy_out(unit, items, grad)
                else:
                    self._into_resident(unit, items, grad, norms)
                    norms.record_stream(self.d2h)
            if grad is not None:
                grad.record_stream(self.d2h)
            del grad, norms
            self.credits.release()

    def _into_resident(self, unit: int, items: list, grad: torch.Tensor | None, norms: torch.Tensor) -> None:
        """The gradient into the unit's resident tile (None: it stays on the device) and its pieces' squared
        norms into ctl; Adam is told (grads_landed) once the copy has landed. Only this thread waits for it,
        never the compute stream. A host that holds none of the unit (several hosts, a unit smaller than their
        slices) lands nothing."""
        if not items:
            return
        tile, span = self.store.resident_tile(unit), slice(items[0].piece, items[-1].piece + 1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.d2h):
            start.record(self.d2h)
            if grad is not None:
                tile[items[0].lo : items[-1].hi].copy_(grad[items[0].lo : items[-1].hi], non_blocking=True)
            self.norms[span].copy_(norms, non_blocking=True)
            end.record(self.d2h)
        self.timeline.append((unit, start, end))
        while not end.query():  # a blocking synchronize would not see an abort
            self.store.check_abort()
            time.sleep(5e-4)
        grads_landed(self.store, items, self.norms[span].numpy())

    def _copy_out(self, unit: int, items: list, grad: torch.Tensor) -> None:
        for item in items:
            slab = free_grad_slab(self.store, item)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.d2h):
                start.record(self.d2h)
                slab.copy_(grad[item.lo : item.hi], non_blocking=True)
                end.record(self.d2h)
                self.ipc_events[item.slab].record(self.d2h)
            self.timeline.append((unit, start, end))
            grad_sent(self.store, item)


class Marks:
    """Phase marks on the compute stream (CUDA events, or wall time on the CPU device)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []
        self.nvtx = NvtxPhases() if self.cuda else None

    def __call__(self, name: str) -> None:
        if self.nvtx is not None:
            self.nvtx(name)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def close(self) -> None:
        if self.nvtx is not None:
            self.nvtx.close()

    def seconds(self) -> list[tuple[str, float]]:
        """(name, seconds since the first mark); call after the step has synchronized."""
        if not self.marks:
            return []
        first = self.marks[0][1]
        if self.cuda:
            return [(n, first.elapsed_time(ev) / 1e3) for n, ev in self.marks]
        return [(n, t - first) for n, t in self.marks]


def copy_intervals(timeline: list[tuple[int, Any, Any]], origin: Any) -> list[tuple[int, float, float]]:
    """(unit, start s, end s) of timed copies relative to the `origin` CUDA event."""
    return [(u, origin.elapsed_time(a) / 1e3, origin.elapsed_time(b) / 1e3) for u, a, b in timeline]
