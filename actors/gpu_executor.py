"""GPU executor: runs the whole step's layer loop, streaming weights in from and gradients out to shm.

Without a GPU the same code runs on the CPU device: same slabs, same semaphores, same order.
"""

from __future__ import annotations

import time

import torch
from megatrain.actors.base import Role, guarded
from megatrain.ipc.protocol import Store, StoreSpec

from megatrain.engine import EngineConfig, StepEngine, resolve_device, resolve_dtype


class SlabSource:
    """WeightSource over the weight slabs: item j of the step comes from slab j % S."""

    def __init__(self, store: Store, device: torch.device, dtype: torch.dtype):
        self.store, self.device, self.dtype = store, device, dtype
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.j, self.wait_s, self.bytes = 0, 0.0, 0

    def reset(self) -> None:
        self.j, self.wait_s, self.bytes = 0, 0.0, 0

    def fetch(self, unit: int) -> torch.Tensor:
        spec = self.store.spec
        assert unit == spec.fetch_order[self.j], f"engine fetched unit {unit} out of protocol order"
        slab = self.j % spec.ipc.weight_slabs
        self.j += 1
        t0 = time.perf_counter()
        self.store.wait(f"w_full{slab}", f"weights of unit {unit} in slab {slab}")
        self.wait_s += time.perf_counter() - t0
        n = spec.layout.structure_of(unit).numel
        out = torch.empty(n, dtype=self.dtype, device=self.device)
        self._copy_in(out, self.store.weight_slab(slab)[:n])
        self.bytes += out.numel() * out.element_size()
        self.store.post(f"w_free{slab}")
        return out

    def _copy_in(self, out: torch.Tensor, src: torch.Tensor) -> None:
        if not self.cuda:
            out.copy_(src)
            return
        compute = torch.cuda.current_stream(self.device)
        self.h2d.wait_stream(compute)  # `out` was just allocated on the compute stream
        with torch.cuda.stream(self.h2d):
            out.copy_(src, non_blocking=True)
        done = self.h2d.record_event()
        compute.wait_event(done)
        out.record_stream(self.h2d)
        done.synchronize()  # the slab may be refilled once the copy has read it


class SlabSink:
    """GradSink over the gradient slabs: item k of the step goes to slab k % G as fp32."""

    def __init__(self, store: Store, device: torch.device, events: list | None):
        self.store, self.device, self.events = store, device, events
        self.d2h = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.k, self.wait_s, self.bytes = 0, 0.0, 0

    def reset(self) -> None:
        self.k, self.wait_s, self.bytes = 0, 0.0, 0

    def emit(self, unit: int, grad: torch.Tensor) -> None:
        spec = self.store.spec
        assert unit == spec.grad_order[self.k], f"engine emitted unit {unit} out of protocol order"
        slab = self.k % spec.ipc.grad_slabs
        self.k += 1
        t0 = time.perf_counter()
        self.store.wait(f"g_free{slab}", f"a free gradient slab for unit {unit}")
        self.wait_s += time.perf_counter() - t0
        dst = self.store.grad_slab(slab)[: grad.numel()]
        grad = grad.detach().float()
        self.bytes += grad.numel() * 4
        if self.d2h is None:
            dst.copy_(grad)
        else:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                dst.copy_(grad, non_blocking=True)
                self.events[slab].record(self.d2h)
            grad.record_stream(self.d2h)
        self.store.post(f"g_full{slab}")


class GpuExecutor(Role):
    def __init__(self, spec: StoreSpec, cfg: EngineConfig, threads: int = 0):
        super().__init__("gpu-executor")
        if threads > 0:
            torch.set_num_threads(threads)
        self.store = Store.attach(spec, ("staging",), role=self.name)
        self.device = resolve_device(cfg)
        dtype = resolve_dtype(cfg, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.engine = StepEngine(spec.model, cfg, self.device, dtype)
        self.handles: list[bytes] | None = None
        events = None
        if self.device.type == "cuda":
            from megatrain.ipc.cuda_events import make_ipc_events, register_host

            register_host(self.store.staging_region())
            events, self.handles = make_ipc_events(spec.ipc.grad_slabs)
        self.source = SlabSource(self.store, self.device, dtype)
        self.sink = SlabSink(self.store, self.device, events)

    def event_handles(self) -> list[bytes] | None:
        return self.handles

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    @guarded
    def step(self, step: int, ids: torch.Tensor, labels: torch.Tensor) -> dict:
        self.source.reset()
        self.sink.reset()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        res = self.engine.step(ids, labels, self.source, self.sink)
        loss, tokens = float(res.loss), int(res.tokens)  # the one host sync of the step
        if self.device.type == "cuda":
            self.sink.d2h.synchronize()
        out = {"loss": loss, "tokens": tokens, "compute_s": time.perf_counter() - t0,
               "weight_wait_s": self.source.wait_s, "grad_wait_s": self.sink.wait_s,
               "h2d_bytes": self.source.bytes, "d2h_bytes": self.sink.bytes}
        if self.device.type == "cuda":
            out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out
