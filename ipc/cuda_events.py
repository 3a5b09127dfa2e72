"""CUDA pieces of the data plane: events shared across processes (pinning: megatrain.cudahost).

The executor registers the staging segment with cudaHostRegister so its DMA reads and writes the
very pages that packers and accumulators in other processes use (pageable memory would be staged
through a driver bounce buffer at a fifth of the bandwidth). Gradient slabs each have an
interprocess event: the executor records it after the slab's D2H copy, and the accumulator that
opened its handle synchronizes on it before reading, so no process ever blocks the GPU stream.
"""

from __future__ import annotations

import torch

from megatrain.cudahost import register_host, unregister_host

__all__ = ["make_ipc_events", "open_ipc_events", "register_host", "unregister_host"]


def make_ipc_events(n: int) -> tuple[list[torch.cuda.Event], list[bytes]]:
    events = [torch.cuda.Event(interprocess=True) for _ in range(n)]
    return events, [e.ipc_handle() for e in events]


def open_ipc_events(handles: list[bytes], device: torch.device) -> list[torch.cuda.Event]:
    return [torch.cuda.Event.from_ipc_handle(device, h) for h in handles]
