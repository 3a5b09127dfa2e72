"""Page-locking existing host memory for DMA (cudaHostRegister), for shared-memory segments and the
executor's offloaded activation checkpoints alike."""

from __future__ import annotations

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
