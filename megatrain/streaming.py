"""The executor's side of the data plane: weight sources and gradient sinks over the staging slabs.

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

from megatrain.errors import AbortError, WaitTimeout
from megatrain.ipc.protocol import Store

_STOP = object()


class SyncSource:
    """CPU device: item j of the step is read from its slab (then freed) or its resident tile."""

    def __init__(self, store: Store, device: torch.device, dtype: torch.dtype):
        self.store, self.device, self.dtype = store, device, dtype
        self.step, self.j, self.wait_s, self.bytes = 0, 0, 0.0, 0

    def begin(self, step: int) -> None:
        self.step, self.j, self.wait_s, self.bytes = step, 0, 0.0, 0

    def end(self) -> None:
        pass

    def _item(self, unit: int) -> int:
        spec = self.store.spec
        assert unit == spec.fetch_order[self.j], f"engine fetched unit {unit} out of protocol order"
        self.j += 1
        return self.j - 1

    def acquire(self, j: int, unit: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Wait until item j's weights are readable on the host; (host tensor, release or None when
        nothing is to be freed: a resident tile changes only after the unit's last use in the step)."""
        spec, store = self.store.spec, self.store
        if spec.resident:
            store.wait_version(unit, self.step, f"Adam's update of unit {unit} before step {self.step}")
            return store.resident_tile(unit), None
        slab = j % spec.num_weight_slabs
        store.wait(f"w_full{slab}", f"weights of unit {unit} in slab {slab}")
        n = spec.layout.structure_of(unit).numel
        return store.weight_slab(slab)[:n], lambda: store.post(f"w_free{slab}")

    def fetch(self, unit: int) -> torch.Tensor:
        j = self._item(unit)
        t0 = time.perf_counter()
        host, release = self.acquire(j, unit)
        self.wait_s += time.perf_counter() - t0
        out = host.to(self.device, self.dtype, copy=True)
        self.bytes += out.numel() * out.element_size()
        if release is not None:
            release()
        return out


class SyncSink:
    """CPU device: item k of the step goes to gradient slab k % G as fp32."""

    def __init__(self, store: Store):
        self.store = store
        self.k, self.wait_s, self.bytes = 0, 0.0, 0

    def begin(self) -> None:
        self.k, self.wait_s, self.bytes = 0, 0.0, 0

    def end(self) -> None:
        pass

    def _item(self, unit: int) -> int:
        """Check the protocol's gradient order; the item's slab."""
        spec = self.store.spec
        assert unit == spec.grad_order[self.k], f"engine emitted unit {unit} out of protocol order"
        self.k += 1
        return (self.k - 1) % spec.ipc.grad_slabs

    def emit(self, unit: int, grad: torch.Tensor) -> None:
        slab = self._item(unit)
        t0 = time.perf_counter()
        self.store.wait(f"g_free{slab}", f"a free gradient slab for unit {unit}")
        self.wait_s += time.perf_counter() - t0
        self.store.grad_slab(slab)[: grad.numel()].copy_(grad.detach())
        self.bytes += grad.numel() * 4
        self.store.post(f"g_full{slab}")


class _Worker:
    """A per-step helper thread whose failure resurfaces in the compute thread."""

    def __init__(self, store: Store, name: str):
        self.store, self.name = store, name
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, target: Any) -> None:
        self.error = None

        def run() -> None:
            try:
                target()
            except BaseException as exc:  # surfaced by check()/join()
                self.error = exc

        self.thread = threading.Thread(target=run, name=self.name, daemon=True)
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def join(self) -> None:
        if self.thread is not None:
            while self.thread.is_alive():
                self.thread.join(self.store.spec.ipc.poll_s)
                self.store.check_abort()
        self.check()

    def acquire(self, sem: threading.Semaphore) -> None:
        """Semaphore acquire that honours the abort flag and this worker's failure."""
        while not sem.acquire(timeout=self.store.spec.ipc.poll_s):
            self.check()
            self.store.check_abort()

    def take(self, q: queue.Queue, what: str) -> Any:
        """Queue get that honours the abort flag, the deadline and this worker's failure."""
        deadline = time.monotonic() + self.store.spec.ipc.wait_timeout_s
        while True:
            try:
                item = q.get(timeout=self.store.spec.ipc.poll_s)
            except queue.Empty:
                self.check()
                self.store.check_abort()
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"waited {self.store.spec.ipc.wait_timeout_s:g}s for {what}") from None
                continue
            if item is _STOP:
                self.check()
                raise AbortError(f"{self.name} stopped")
            return item


class StreamedSource(SyncSource):
    def __init__(self, store: Store, device: torch.device, dtype: torch.dtype, prefetch: int):
        super().__init__(store, device, dtype)
        # prefetch 0 is the no-double-buffering ablation: copies go on the compute stream itself, so
        # no transfer ever overlaps a kernel.
        self.h2d = torch.cuda.Stream(device) if prefetch > 0 else torch.cuda.default_stream(device)
        self.prefetch = max(prefetch, 1)
        self.ready: queue.Queue = queue.Queue()
        self.worker = _Worker(store, "h2d-loader")
        self.credits = threading.Semaphore(self.prefetch)
        self.timeline: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self, step: int) -> None:
        super().begin(step)
        self.credits = threading.Semaphore(self.prefetch)
        self.ready = queue.Queue()
        self.timeline = []
        self.worker.start(self._load)

    def end(self) -> None:
        self.worker.join()

    def _load(self) -> None:
        try:
            for j, unit in enumerate(self.store.spec.fetch_order):
                self.worker.acquire(self.credits)
                host, release = self.acquire(j, unit)
                start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(self.h2d):
                    start.record(self.h2d)
                    out = torch.empty(host.numel(), dtype=self.dtype, device=self.device)
                    out.copy_(host, non_blocking=True)
                    done.record(self.h2d)
                self.ready.put((unit, out, done))
                self.timeline.append((unit, start, done))
                if release is not None:
                    done.synchronize()  # a slab may be refilled once this copy has read it
                    release()
        finally:
            self.ready.put(_STOP)

    def fetch(self, unit: int) -> torch.Tensor:
        self._item(unit)
        t0 = time.perf_counter()
        got, out, ready = self.worker.take(self.ready, f"weights of unit {unit}")
        self.wait_s += time.perf_counter() - t0
        assert got == unit, (got, unit)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)
        out.record_stream(compute)
        self.credits.release()
        self.bytes += out.numel() * out.element_size()
        return out


class StreamedSink(SyncSink):
    def __init__(self, store: Store, device: torch.device, ipc_events: list):
        super().__init__(store)
        self.device, self.ipc_events = device, ipc_events
        self.d2h = torch.cuda.Stream(device)
        self.worker = _Worker(store, "d2h-drain")
        self.todo: queue.Queue = queue.Queue()
        self.credits = threading.Semaphore(store.spec.ipc.grad_slabs)
        self.timeline: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

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
        self._item(unit)  # the drain thread derives the same slab from its own count
        grad = grad.detach().float()
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        t0 = time.perf_counter()
        self.worker.acquire(self.credits)  # at most G gradients queued on the GPU
        self.wait_s += time.perf_counter() - t0
        self.bytes += grad.numel() * 4
        self.todo.put((unit, grad, done))

    def _drain(self) -> None:
        spec = self.store.spec
        for k in range(len(spec.grad_order)):
            unit, grad, done = self.worker.take(self.todo, f"the gradient of item {k}")
            slab = k % spec.ipc.grad_slabs
            self.store.wait(f"g_free{slab}", f"a free gradient slab for unit {unit}")
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.d2h.wait_event(done)
            with torch.cuda.stream(self.d2h):
                start.record(self.d2h)
                self.store.grad_slab(slab)[: grad.numel()].copy_(grad, non_blocking=True)
                end.record(self.d2h)
                self.ipc_events[slab].record(self.d2h)
            grad.record_stream(self.d2h)
            self.timeline.append((unit, start, end))
            del grad
            self.store.post(f"g_full{slab}")
            self.credits.release()


class Marks:
    """Phase marks on the compute stream (CUDA events, or wall time on the CPU device)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []

    def __call__(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

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
