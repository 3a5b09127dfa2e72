"""The GPU part of a memory plan: the engine's sizes the auto rule picks for the GPU memory there is, the
terms of its memory model at those sizes (megatrain/memory/autosize.py), the budget engine.gpu_memory_gib sets
(megatrain/memory/budget.py), and the fp32 gradients several executors queue for their sum."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatrain.config.engine import EngineConfig
from megatrain.errors import ConfigError, MegatrainError, ResourceError
from megatrain.memory import autosize
from megatrain.memory import budget as gpubudget
from megatrain.memory.hosts import largest_slice
from megatrain.model.arch import Arch
from megatrain.model.layout import StoreLayout

# The optimizer of the units the GPU holds (engine.gpu_optimizer, actors/executor/gpustate.py): per parameter
# its fp32 weights and both moments, the weights in the compute dtype (none apart in fp32: they are the master
# weights), and the gradient waiting there for the global norm (in the staging dtype, the compute dtype); beside
# them the update's scratch, two fp32 vectors of a chunk (megatrain/host/adamw.py TENSOR_CHUNK), and a margin
# the plan's peak may be off by (allocator fragmentation), kept free of them.
GPU_STATE_SCRATCH = 2 * (64 << 20) * 4
GPU_STATE_MARGIN_FRACTION, GPU_STATE_MARGIN_LEAST = 0.05, 2 << 30
GPU_STATE = "optimizer of the units the GPU holds (engine.gpu_optimizer)"
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
    gpu_units: int = 0  # engine.gpu_optimizer resolved: the units whose optimizer the GPU holds
    gpu_units_why: str = ""


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
    resident: bool = True,
) -> GpuPart:
    """Sizes and terms for `batch` sequences of `seq` tokens on each of `executors` GPUs with `gpu_free` free
    (None: the CPU device, or a GPU not measured here: the fixed sizes stand in), each executor's pinned
    checkpoints within `host_room` bytes (None: not bounded here), then the units whose optimizer the GPU
    holds beside them (`resident`: the store's staging mode is resident)."""
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
    try:
        room = None if sized is None else sized + reduction  # as the run's choose_sizes() measures it
        held, held_why = resolve_gpu_units(engine, arch.layout, room, sum(terms.values()), executors, hosts, resident)
    except MegatrainError as exc:
        held, held_why, error = 0, "", error or str(exc)
    if held:
        dtype_bytes = 2 if engine.compute_dtype == "bf16" else 4
        terms[GPU_STATE] = gpu_state_bytes(arch.layout, held, dtype_bytes, executors, hosts)
    budget = gpubudget.budget_bytes(engine)
    return GpuPart(
        gpu_units=held,
        gpu_units_why=held_why,
        sizes=sizes,
        why=why,
        error=error,
        terms=terms,
        free=gpu_free,
        budget=None if budget is None else budget - gpubudget.CONTEXT_BYTES,
        budget_note=budget_note,
    )


def gpu_state_bytes(layout: StoreLayout, units: int, dtype_bytes: int, executors: int = 1, hosts: int = 1) -> int:
    """GPU memory of the optimizer of the first `units` units of the forward (embedding, layers, head) on the
    GPU that holds the most of it, the update's scratch included (0 for none). With several executors each
    holds the state of its share (gpu_owners) and the weights of the others' in the compute dtype, which their
    owners send it after each update; over several hosts the state of its host's slice of its share (the
    first host's, the largest) and every held unit's weights whole."""
    if units <= 0:
        return 0
    # per element of state: fp32 moments and the gradient; the fp32 weights apart where the engine reads bf16
    state = 8 + dtype_bytes + (4 if dtype_bytes != 4 else 0)
    served = gpu_params(layout, units) * dtype_bytes
    return max(own * state for own in _shares(layout, units, executors, hosts)) + served + GPU_STATE_SCRATCH


def gpu_params(layout: StoreLayout, units: int) -> int:
    """The parameters of the first `units` units of the forward: embedding, layers, then the final norm and head."""
    return sum(layout.structure_of(u).numel for u in _forward(layout)[:units])


def _forward(layout: StoreLayout) -> list[int]:
    return [0, *range(1, layout.num_layers + 1), layout.num_layers + 1]


def gpu_owners(layout: StoreLayout, units: int, executors: int) -> dict[int, int]:
    """Which executor holds the state of each of the first `units` units of the forward and updates it: each in
    turn to the one holding the fewest parameters so far (the lowest rank on a tie), so that the shares, and the
    update's time, come out even."""
    owners, load = {}, [0] * max(executors, 1)
    for unit in _forward(layout)[:units]:
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        owners[unit] = rank
        load[rank] += layout.structure_of(unit).numel
    return owners


def _shares(layout: StoreLayout, units: int, executors: int, hosts: int = 1) -> list[int]:
    """The elements each executor of the first host (the largest slices) holds the state of."""
    shares = [0] * max(executors, 1)
    for unit, rank in gpu_owners(layout, units, executors).items():
        numel = layout.structure_of(unit).numel
        shares[rank] += min(numel, largest_slice(layout.units[unit].tile, hosts))
    return shares


def gpu_units_refusal(units: int, num_units: int, resident: bool) -> str:
    """Why a run cannot hold the optimizer of `units` units on its GPU ("" where it can)."""
    if units == 0:
        return ""
    if units < 0 or units > num_units:
        return f"the model has {num_units} units (embedding, layers, final norm and head): 0 to {num_units}"
    if not resident:
        return (
            "the units the GPU holds need the resident copy, where their gradients' norms go as any unit's: "
            "ipc.staging resident"
        )
    return ""


def auto_gpu_units(layout: StoreLayout, room: int, dtype_bytes: int, executors: int = 1, hosts: int = 1) -> int:
    """The most units, from the forward's first, whose optimizer fits `room` bytes of each executor's GPU."""
    units = 0
    while units < len(layout.units) and gpu_state_bytes(layout, units + 1, dtype_bytes, executors, hosts) <= room:
        units += 1
    return units


def gpu_state_room(free: int, peak: int) -> int:
    """What the GPU leaves the optimizer beside the step's planned peak, less a margin."""
    return free - peak - max(GPU_STATE_MARGIN_LEAST, int(free * GPU_STATE_MARGIN_FRACTION))


def resolve_gpu_units(
    engine: EngineConfig,
    layout: StoreLayout,
    free: int | None,
    peak: int,
    executors: int,
    hosts: int,
    resident: bool,
) -> tuple[int, str]:
    """engine.gpu_optimizer resolved, and why: the GPU's `free` bytes (None: the CPU device) beside the step's
    planned `peak`. An explicit count this run cannot hold is refused, naming the key."""
    asked, n = engine.gpu_optimizer, len(layout.units)
    dtype_bytes = 2 if engine.compute_dtype == "bf16" else 4
    if asked != "auto":
        refusal = gpu_units_refusal(int(asked), n, resident)
        if refusal:
            raise ConfigError(f"engine.gpu_optimizer {asked}: {refusal}")
        need = gpu_state_bytes(layout, int(asked), dtype_bytes, executors, hosts)
        if free is not None and need > gpu_state_room(free, peak):
            raise ResourceError(
                f"engine.gpu_optimizer {asked}: their optimizer takes {gpubudget.gib(need)} of GPU memory; beside "
                f"the step's planned peak of {gpubudget.gib(peak)} the GPU's {gpubudget.gib(free)} leave "
                f"{gpubudget.gib(max(gpu_state_room(free, peak), 0))} (less a margin): fewer units, or auto"
            )
        return int(asked), "as set"
    refusal = gpu_units_refusal(1, n, resident)
    if engine.device != "cuda":
        return 0, "the CPU device"
    if refusal:
        return 0, refusal
    if free is None:
        return 0, "the GPU's free memory is not measured here"
    room = gpu_state_room(free, peak)
    units = auto_gpu_units(layout, room, dtype_bytes, executors, hosts)
    shared = f" on each GPU at most, the units shared among {executors}" if executors > 1 else ""
    shared += f", each host holding its slice of their state (of {hosts})" if hosts > 1 else ""
    held = gpubudget.gib(gpu_state_bytes(layout, units, dtype_bytes, executors, hosts))
    return units, (
        f"{units} of {n} units ({held}{shared}) "
        f"in the {gpubudget.gib(max(room, 0))} the GPU leaves beside the step's peak"
    )
