"""Gradient sinks of N executors sharing one store: every executor computes its rows of the batch, each
unit's gradient is summed over the executors (megatrain/collective.py) into executor 0, and only executor
0's sink (the one-executor sink of executor_streams.py) sends it to the host: one copy per unit reaches the store
and one Adam updates it.

The sum is taken in fp32 whatever the compute dtype (a bf16 sum of bf16 parts would be rounded twice). A unit's
resident tile is overwritten by its summed gradient only after every executor's part exists, so after
every executor's last read of the unit's weights in the step: the reduction cannot complete earlier.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from megatrain.actors.executor_streams import StreamedSink, SyncSink
from megatrain.actors.executor_threads import Worker
from megatrain.collective import Group
from megatrain.ipc.protocol import Store
from megatrain.ipc.protocol.executor import Walk
from megatrain.memory.gpu import REDUCE_CREDITS


def _order(store: Store) -> Walk:
    """The gradient walk every executor follows (executor 0's inner sink checks its own too)."""
    return Walk(store.spec.grad_order, store.spec.emit_items, "emitted")


def _fp32(grad: torch.Tensor) -> torch.Tensor:
    """The gradient to sum, in fp32: a new tensor unless it is fp32 already (the engine is done with it)."""
    grad = grad.detach()
    return grad if grad.dtype == torch.float32 else grad.float()


class SyncReducingSink:
    """CPU device: each gradient is reduced on the spot (the host waits); executor 0 then emits it."""

    def __init__(self, store: Store, group: Group, inner: SyncSink | None):
        self.store, self.group, self.inner = store, group, inner
        self.begin()

    def begin(self) -> None:
        self.order, self.wait_s, self.bytes = _order(self.store), 0.0, 0
        if self.inner is not None:
            self.inner.begin()

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()
            self.wait_s, self.bytes = self.inner.wait_s, self.inner.bytes

    def emit(self, unit: int, grad: torch.Tensor) -> None:
        self.order.next(unit)
        g = _fp32(grad)
        self.group.finish(self.group.reduce_(g))
        if self.inner is not None:
            self.inner.emit(unit, g)


class StreamedReducingSink:
    """CUDA: a reducer thread issues each gradient's reduction on its own stream after the backward that
    made it (an event, no host wait), and on executor 0 hands the sum to the streamed sink from that
    stream, so the reduction and the copy out overlap the next layers' compute like the copy alone did."""

    def __init__(self, store: Store, group: Group, device: torch.device, inner: StreamedSink | None):
        self.store, self.group, self.device, self.inner = store, group, device, inner
        self.comm = torch.cuda.Stream(device)
        self.worker = Worker(store, "reducer")
        self.todo: queue.Queue = queue.Queue()
        self.credits = threading.Semaphore(REDUCE_CREDITS)
        self.order = _order(store)
        self.wait_s, self.bytes = 0.0, 0

    @property
    def timeline(self) -> list:
        return self.inner.timeline if self.inner is not None else []

    def begin(self) -> None:
        self.order, self.wait_s, self.bytes = _order(self.store), 0.0, 0
        self.todo = queue.Queue()
        self.credits = threading.Semaphore(REDUCE_CREDITS)
        if self.inner is not None:
            self.inner.begin()
        self.worker.start(self._reduce)

    def end(self) -> None:
        self.worker.join()
        self.comm.synchronize()
        if self.inner is not None:
            self.inner.end()
            self.wait_s += self.inner.wait_s
            self.bytes = self.inner.bytes

    def emit(self, unit: int, grad: torch.Tensor) -> None:
        self.order.next(unit)
        g = _fp32(grad)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        t0 = time.perf_counter()
        self.worker.acquire(self.credits, f"a reduction credit for unit {unit}")
        self.wait_s += time.perf_counter() - t0
        self.todo.put((unit, g, done))

    def _reduce(self) -> None:
        torch.cuda.set_device(self.device)
        for k in range(len(self.store.spec.grad_order)):
            unit, g, done = self.worker.take(self.todo, f"the gradient of item {k} to reduce")
            with torch.cuda.stream(self.comm), torch.cuda.nvtx.range(f"reduce:{unit}"):
                self.comm.wait_event(done)
                self.group.finish(self.group.reduce_(g))  # the comm stream waits for the sum
                if self.inner is not None:
                    self.inner.emit(unit, g)  # its copy waits on the comm stream (its current stream)
            g.record_stream(self.comm)
            del g
            self.credits.release()
