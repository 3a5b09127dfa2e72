"""The GPU part of a memory plan: the engine's sizes the auto rule picks for the GPU memory there is, the
terms of its memory model at those sizes (megatrain/memory/autosize.py), the budget engine.gpu_memory_gib sets
(megatrain/memory/budget.py), and the fp32 gradients several executors queue for their sum."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatrain.config.engine import EngineConfig
from megatrain.errors import ResourceError
from megatrain.memory import autosize
from megatrain.memory import budget as gpubudget
from megatrain.memory.hosts import largest_slice
from megatrain.model.arch import Arch
from megatrain.model.layout import StoreLayout

REDUCE_CREDITS = 2  # fp32 gradients queued for their reduction on the GPU (actors/executor/reduce.py)
REDUCTION = "fp32 gradients awaiting the executors' sum"


def reduction_bytes(layout: StoreLayout, hosts: int = 1) -> int:
    """GPU memory for the fp32 gradients waiting for their reduction (the credits' and the one reducing),
    beside what autosize.py plans for one executor; over several hosts, the reduce-scatter's buffer too (a
    layer's gradient padded to the hosts' slices)."""
    layer = max(layout.structure_of(u).numel for u in range(1, layout.num_layers + 1))
    # every unit's gradient is padded to the hosts' slices, the embedding's and the head's too
    padded = max(hosts * largest_slice(u.tile, hosts) for u in layout.units) if hosts > 1 else 0
    return ((REDUCE_CREDITS + 1) * layer + padded) * 4


@dataclass(frozen=True, kw_only=True)
class GpuPart:
    """The sizes chosen for one executor's GPU and the terms of its peak at them."""

    sizes: autosize.Sizes | None  # None: not sized (a plan of the host part alone)
    why: str
    error: str = ""  # why no sizes fit ("" where some do)
    terms: dict[str, int] = field(default_factory=dict)  # empty: the CPU device
    free: int | None = None  # the GPU's free memory planned for (None: not known here)
    budget: int | None = None  # engine.gpu_memory_gib less the CUDA context; None: no budget
    budget_note: str = ""


def gpu_part(
    arch: Arch,
    engine: EngineConfig,
    batch: int,
    seq: int,
    executors: int,
    gpu_free: int | None,
    clip: bool,
    host_room: int | None,
    hosts: int = 1,
) -> GpuPart:
    """Sizes and terms for `batch` sequences of `seq` tokens on each of `executors` GPUs with `gpu_free` free
    (None: the CPU device, or a GPU not measured here: the fixed sizes stand in), each executor's pinned
    checkpoints within `host_room` bytes (None: not bounded here)."""
    cuda = engine.device == "cuda"
    sized, budget_note = gpubudget.planning_room(engine, gpu_free) if cuda else (None, "")
    reduction = reduction_bytes(arch.layout, hosts) if executors > 1 or hosts > 1 else 0
    if sized is not None:
        sized -= reduction  # beside the activations, as the run's choose_sizes() leaves it
    try:
        sizes, why = autosize.choose(arch, engine, batch, seq, sized, clip, host_room)
        error = ""
    except ResourceError as exc:
        error, why = str(exc), ""
        sizes = autosize.Sizes(1, 1, 1, 512, 1)  # the least the engine can do, to show the rest of the plan
    if not cuda:
        return GpuPart(sizes=sizes, why=why, error=error)
    terms = autosize.gpu_terms(arch, autosize.apply(engine, sizes), batch, seq, sizes)
    if reduction:
        terms[REDUCTION] = reduction
    budget = gpubudget.budget_bytes(engine)
    return GpuPart(
        sizes=sizes,
        why=why,
        error=error,
        terms=terms,
        free=gpu_free,
        budget=None if budget is None else budget - gpubudget.CONTEXT_BYTES,
        budget_note=budget_note,
    )
