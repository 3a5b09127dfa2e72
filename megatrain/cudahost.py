"""Page-locking existing host memory for DMA (cudaHostRegister), for shared-memory segments and the
executor's offloaded activation checkpoints alike."""

from __future__ import annotations

import weakref

import torch


def register_host(region: torch.Tensor) -> None:
    """Page-lock an existing host range for DMA (cudaHostRegisterDefault)."""
    err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.numel() * region.element_size(), 0)
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
