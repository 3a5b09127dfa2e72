"""CUDA pieces of the data plane: events shared across processes (pinning: megatrain.host.cudahost).

The executor registers the staging segment with cudaHostRegister so its DMA reads and writes the
very pages that packers and accumulators in other processes use (pageable memory would be staged
through a driver bounce buffer at a fifth of the bandwidth). Gradient slabs each have an
interprocess event: the executor records it after the slab's D2H copy, and the accumulator that
opened its handle synchronizes on it before reading, so no process ever blocks the GPU stream.
CUDA refuses to open an event handle in the process that made the event (cudaIpcOpenEventHandle:
invalid device context), which is where every worker lives under the in-process runner: there the
handle resolves to the executor's own event object.
"""

from __future__ import annotations

import weakref

import torch

from megatrain.host.cudahost import pin_while_alive

__all__ = ["make_ipc_events", "open_ipc_events", "pin_while_alive"]


# handle -> event, for the events this process made; weak, so a detached executor's events still go.
_MADE_HERE: weakref.WeakValueDictionary[bytes, torch.cuda.Event] = weakref.WeakValueDictionary()


def make_ipc_events(n: int) -> tuple[list[torch.cuda.Event], list[bytes]]:
    events = [torch.cuda.Event(interprocess=True) for _ in range(n)]
    handles = [e.ipc_handle() for e in events]
    _MADE_HERE.update(zip(handles, events, strict=True))
    return events, handles


def open_ipc_events(handles: list[bytes], device: torch.device) -> list[torch.cuda.Event]:
    """The events behind `handles`: opened from another process's handles, or this process's own."""
    return [_open(h, device) for h in handles]


def _open(handle: bytes, device: torch.device) -> torch.cuda.Event:
    own = _MADE_HERE.get(handle)
    return own if own is not None else torch.cuda.Event.from_ipc_handle(device, handle)
