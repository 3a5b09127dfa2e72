"""Where the K-layer activation checkpoints live between the forward and their block's backward.

On the GPU they would grow with depth (one [batch, seq, hidden] tensor per block: 470 MB per block at
16×4096 tokens of a 3584-wide model), which is what keeps GPU memory from being independent of the
layer count. With offload on, each checkpoint goes to pinned host memory on its own copy stream as
soon as it is produced, and comes back one block ahead of its recompute in the backward. Both copies
are ordered only by CUDA events; the compute stream waits on the GPU, never on the host.

A fourth stream (besides compute, weights H2D and gradients D2H) keeps these copies out of the weight
loader's and the gradient drain's FIFO order, which their helper threads decide.
"""

from __future__ import annotations

import torch

from megatrain.host.cudahost import register_host, unregister_host
from megatrain.memory.host import host_checkpoints as host_checkpoints  # the engine counts them so


class _Registered:
    """A host tensor page-locked with cudaHostRegister for as long as this object lives.

    Registered rather than torch's pinned allocator, which rounds every block up to a power of two
    (470 MB would take 512 MB of page-locked RAM, per block). Unregistered before the memory is freed:
    a stale registration over a range that malloc later maps again makes copies fail."""

    def __init__(self, like: torch.Tensor):
        self.t = torch.empty(like.shape, dtype=like.dtype)
        register_host(self.t)

    def __del__(self) -> None:
        unregister_host(self.t)


class Checkpoints:
    """Block b's input activation: `put` in the forward, `prefetch`/`get` in the backward."""

    def __init__(self, device: torch.device, host_blocks: int):
        """`host_blocks`: the first blocks whose checkpoints go to pinned host memory (the rest stay on the
        GPU; on the CPU device every one stays where it is)."""
        self.device = device
        self.host_blocks = host_blocks if device.type == "cuda" else 0
        self.stream = torch.cuda.Stream(device) if self.host_blocks else None
        self.host: dict[int, _Registered] = {}  # pinned buffers, reused across steps
        self.kept: dict[int, torch.Tensor] = {}  # on the device: not offloaded, or fetched back
        self.ready: dict[int, torch.cuda.Event] = {}

    def host_bytes(self) -> int:
        return sum(r.t.numel() * r.t.element_size() for r in self.host.values())

    def put(self, b: int, h: torch.Tensor) -> None:
        if b >= self.host_blocks:
            self.kept[b] = h
            return
        reg = self.host.get(b)
        if reg is None or reg.t.shape != h.shape or reg.t.dtype != h.dtype:
            self.host.pop(b, None)  # unregistered before the new one is taken
            reg = self.host[b] = _Registered(h)
        buf = reg.t
        produced = torch.cuda.current_stream(self.device).record_event()
        self.stream.wait_event(produced)
        with torch.cuda.stream(self.stream):
            buf.copy_(h, non_blocking=True)
        h.record_stream(self.stream)  # its memory may be reused only after the copy has read it

    def prefetch(self, b: int) -> None:
        """Start bringing block b's checkpoint back (no-op if it is on the device already)."""
        if b >= self.host_blocks or b in self.kept or b < 0:
            return
        # The stream is FIFO, so this copy runs after this block's D2H copy in the forward.
        with torch.cuda.stream(self.stream):
            self.kept[b] = self.host[b].t.to(self.device, non_blocking=True)
            self.ready[b] = self.stream.record_event()

    def get(self, b: int) -> torch.Tensor:
        self.prefetch(b)
        h = self.kept.pop(b)
        ev = self.ready.pop(b, None)
        if ev is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(ev)
            h.record_stream(compute)
        return h
