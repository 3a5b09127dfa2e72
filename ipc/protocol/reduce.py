"""GPU memory for the fp32 gradients of several executors waiting for their reduction, as the launcher asks for
it with a ModelSpec. The term is megatrain/memory/gpu.py's; the reducer itself runs beside the executor
(actors/executor_reduce.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatrain.memory.gpu import reduction_bytes as gpu_reduction_bytes

if TYPE_CHECKING:
    from megatrain.model import ModelSpec


def reduction_bytes(model: ModelSpec) -> int:
    """GPU memory for the fp32 gradients waiting for their reduction (megatrain/memory/gpu.py)."""
    return gpu_reduction_bytes(model.layout)
