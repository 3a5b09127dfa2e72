"""Page-locking existing host memory for DMA (cudaHostRegister), for shared-memory segments and the
executor's offloaded activation checkpoints alike; and the CUDA allocator settings the executor needs."""

from __future__ import annotations

import os
import weakref

import torch

from megatrain.host.hostmem import fault_in

FAULT_IN_THREADS = 8


def register_host(region: torch.Tensor) -> None:
    """Page-lock an existing host range for DMA (cudaHostRegisterDefault). Its pages are faulted in first,
    in parallel: the registration faults every page of this process's mapping on one thread otherwise
    (a 14 GiB resident copy: 1.3-1.6 s, against 0.5-0.6 s with its page tables already filled)."""
    nbytes = region.numel() * region.element_size()
    fault_in([(region.data_ptr(), nbytes)], FAULT_IN_THREADS)
    err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {region.numel() * region.element_size()} bytes failed: {err}")


def unregister_host(region: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(region.data_ptr())
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister failed: {err}")


def pin_while_alive(owner: object, regions: list[torch.Tensor], device: torch.device) -> None:
    """Page-lock `regions` (views of mappings `owner` holds) until `owner` is collected, then unlock them
    first: a registration outliving its mapping makes the next mapping at that address fail to register
    (the in-process runner runs one executor after another in one process). A weakref callback runs
    before the owner's attributes, and so its mappings, are released. Not at interpreter exit: the
    process's end releases both, and CUDA may already be gone."""
    done: list[torch.Tensor] = []
    try:
        for region in regions:
            register_host(region)
            done.append(region)
    except BaseException:
        _unpin(done, device)
        raise
    weakref.finalize(owner, _unpin, done, device).atexit = False


def _unpin(regions: list[torch.Tensor], device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy of the owner's streams may still read or write them
    for region in regions:
        unregister_host(region)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def use_expandable_segments() -> str:
    """Make the caching allocator grow and shrink its segments instead of keeping fixed blocks, unless the
    user's PYTORCH_CUDA_ALLOC_CONF says otherwise; returns the line to log. The engine's activations change
    size phase by phase (a last block of whole and lean layers, recompute blocks, loss chunks): with fixed
    blocks 5.6-5.9 GiB stayed reserved but unusable and the step ran out of memory on an H100 at 7.6B and
    on an H200 at 14.8B, where the same plan trains with expandable segments. Called before the process's
    first CUDA allocation (the setting is read then); later, torch's runtime setter takes it."""
    conf = os.environ.get(ALLOC_CONF, "")
    if "expandable_segments" in conf:
        return f"CUDA allocator: {ALLOC_CONF}={conf} (as set)"
    os.environ[ALLOC_CONF] = f"{conf},expandable_segments:True" if conf else "expandable_segments:True"
    if torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return "CUDA allocator: expandable segments"
