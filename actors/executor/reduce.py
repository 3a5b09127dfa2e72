"""Gradient sinks of N executors sharing one store: every executor computes its rows of the batch, each
unit's gradient is summed over the executors (megatrain/collective.py) into executor 0, and only executor
0's sink (the one-executor sink of executor_streams.py) sends it to the host: one copy per unit reaches the store
and one Adam updates it.

The sum is taken in fp32 whatever the compute dtype (a bf16 sum of bf16 parts would be rounded twice). A unit's
resident tile is overwritten by its summed gradient only after every executor's part exists, so after
every executor's last read of the unit's weights in the step: the reduction cannot complete earlier.

Over several hosts (StoreSpec.hosts), executor 0 of each host then reduce-scatters its host's sum among the
hosts (HostScatter): it holds the whole run's sum of its own slice of the unit, and its inner sink lands only
its own pieces (StoreSpec.emit_items are this host's).
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from megatrain.actors.executor.gpustate import GpuState
from megatrain.actors.executor.streams import StreamedSink, SyncSink
from megatrain.actors.executor.threads import Worker
from megatrain.collective import Group
from megatrain.errors import MegatrainError
from megatrain.ipc.protocol import Store, StoreSpec
from megatrain.ipc.protocol.executor import Walk
from megatrain.memory.gpu import REDUCE_CREDITS
from megatrain.memory.hosts import largest_slice


def _order(store: Store) -> Walk:
    """The gradient walk every executor follows (executor 0's inner sink checks its own too)."""
    return Walk(store.spec.grad_order, store.spec.emit_items, "emitted")


def _fp32(grad: torch.Tensor) -> torch.Tensor:
    """The gradient to sum, in fp32: a new tensor unless it is fp32 already (the engine is done with it)."""
    grad = grad.detach()
    return grad if grad.dtype == torch.float32 else grad.float()


class HostScatter:
    """Executor 0 of a host in a run over several hosts: a unit's gradient (its host's sum, fp32) summed over
    the hosts, each keeping its own slice. The hosts' slices are L = largest_slice(tile, H) elements each, so
    the gradient zero-padded to H*L is H equal chunks; the reduce-scatter writes this host's chunk in place
    (NCCL's in-place form: the output is the input's own chunk), and the result is the whole-length gradient
    whose own slice holds the run's sum (the rest is this host's part only: no own piece lies there)."""

    def __init__(self, spec: StoreSpec, group: Group):
        if group.size != spec.hosts or group.rank != spec.host:
            raise MegatrainError(
                f"the hosts' group has rank {group.rank} of {group.size}; the store is host {spec.host} of {spec.hosts}"
            )
        self.group, self.host, self.hosts = group, spec.host, spec.hosts
        self.chunk = [largest_slice(u.tile, spec.hosts) for u in spec.layout.units]

    def __call__(self, unit: int, g: torch.Tensor) -> torch.Tensor:
        size, n = self.chunk[unit], g.numel()
        full = g if n == size * self.hosts else torch.nn.functional.pad(g, (0, size * self.hosts - n))
        self.group.reduce_scatter_(full, full[self.host * size : (self.host + 1) * size])
        return full[:n]


def _summed(
    unit: int,
    g: torch.Tensor,
    group: Group | None,
    hosts: HostScatter | None,
    last: bool,
    held: GpuState | None = None,
    rank: int = 0,
) -> torch.Tensor | None:
    """The gradient summed over this host's executors (`group`, into executor 0) and, on executor 0 (`last`)
    over several hosts, over the hosts (its own slice); None where this executor's part ends with the sum.
    A unit whose optimizer another executor holds (`held`, this executor's) is then handed to it (_hand_off)."""
    if group is not None:
        group.finish(group.reduce_(g))
    if last and hosts is not None:
        g = hosts(unit, g)
    if group is not None:
        _hand_off(unit, g, group, held, rank)
    return g if last else None


def _hand_off(unit: int, g: torch.Tensor, group: Group, held: GpuState | None, rank: int) -> None:
    """A unit whose optimizer an executor other than 0 holds: the sum the reduction left on executor 0 (over
    several hosts, this host's slice of the hosts' sum) goes to every executor of the host (a broadcast: gloo
    has no send a poll sees complete) and its owner keeps it in the dtype executor 0's sink lands gradients in,
    the same bits. Executor 0's sink still gives Adam the unit's squared norms."""
    if held is None or unit not in held.units or held.owner[unit] == 0:
        return
    lo, hi = held.slices[unit]
    if hi > lo:
        group.broadcast_(g[lo:hi], 0)
    if held.owner[unit] == rank:
        held.keep(unit, g)


class SyncReducingSink:
    """CPU device: each gradient is reduced on the spot (the host waits); executor 0 then emits it.
    `group`: this host's executors (None: one per host); `hosts`: executor 0's sum over several hosts."""

    def __init__(
        self,
        store: Store,
        group: Group | None,
        inner: SyncSink | None,
        hosts: HostScatter | None = None,
        held: GpuState | None = None,
        rank: int = 0,
    ):
        self.store, self.group, self.inner, self.hosts = store, group, inner, hosts
        self.held, self.rank = held, rank  # the units whose optimizer the executors hold (gpustate.py)
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
        g = _summed(unit, _fp32(grad), self.group, self.hosts, self.inner is not None, self.held, self.rank)
        if self.inner is not None:
            self.inner.emit(unit, g)


class StreamedReducingSink:
    """CUDA: a reducer thread issues each gradient's reduction on its own stream after the backward that
    made it (an event, no host wait), and on executor 0 hands the sum to the streamed sink from that
    stream, so the reduction and the copy out overlap the next layers' compute like the copy alone did. Over
    several hosts the hosts' reduce-scatter (NCCL) follows on the same stream."""

    def __init__(
        self,
        store: Store,
        group: Group | None,
        device: torch.device,
        inner: StreamedSink | None,
        hosts: HostScatter | None = None,
        held: GpuState | None = None,
        rank: int = 0,
    ):
        self.store, self.group, self.device, self.inner, self.hosts = store, group, device, inner, hosts
        self.held, self.rank = held, rank  # the units whose optimizer the executors hold (gpustate.py)
        self.comm = torch.cuda.Stream(device)
        self.worker = Worker(store, "reducer")
        self.todo: queue.Queue = queue.Queue()
        self.credits = threading.Semaphore(REDUCE_CREDITS)
        self.order = _order(store)
        self.wait_s, self.bytes = 0.0, 0

    @property
    def timeline(self) -> list:
        return self.inner.timeline if self.inner is not None else []

    def warm(self) -> None:
        """One small collective on each of this sink's NCCL groups, from its stream, waited for. NCCL makes a
        group's communicator and its buffers at the group's first collective, with its own allocations outside
        torch's allocator: made here, at the join, while the GPU is empty, not in the first backward, where the
        allocator already holds all but the plan's margin (the hosts' reduce-scatter failed so, out of memory)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.comm):
            if self.group is not None:
                self.group.finish(self.group.reduce_(torch.zeros(1, device=self.device)))
            if self.hosts is not None:
                full = torch.zeros(self.hosts.hosts, device=self.device)
                self.hosts.group.reduce_scatter_(full, full[self.hosts.host : self.hosts.host + 1])
        self.comm.synchronize()

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
                # the comm stream waits for the sums; a padded buffer is made on it (freed in its order)
                total = _summed(unit, g, self.group, self.hosts, self.inner is not None, self.held, self.rank)
                if self.inner is not None:
                    self.inner.emit(unit, total)  # its copy waits on the comm stream (its current stream)
                del total
            g.record_stream(self.comm)
            del g
            self.credits.release()
