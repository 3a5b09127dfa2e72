"""engine.gpu_memory_gib: the most GPU memory a run may take on each of its GPUs.

The budget counts what nvidia-smi shows for the run's process on a GPU: the CUDA context (CUDA's own
memory, outside PyTorch's caching allocator: about half a GiB) and everything the allocator reserves. So
the automatic sizes (megatrain/memory/autosize.py) plan with the budget less the context, or with the free memory
where less is free, and the executor caps the caching allocator at the budget less its context
(torch.cuda.set_per_process_memory_fraction) before it allocates anything: a tensor beyond the cap is
refused with an out-of-memory error instead of taking more. Outside the allocator stay, besides the
context, NCCL's buffers with several GPUs; the plan's margin covers them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatrain.config.engine import EngineConfig
from megatrain.errors import ResourceError
from megatrain.memory import autosize
from megatrain.model.arch import Arch

if TYPE_CHECKING:
    from megatrain.model.spec import ModelSpec

GIB = 2**30
KEY = "engine.gpu_memory_gib"
# A CUDA context with PyTorch's kernels loaded lazily, as a process shows in nvidia-smi before it allocates
# (0.5-0.6 GiB on an H100 and an H200): what the plan counts where no executor has measured its own.
CONTEXT_BYTES = int(0.5 * GIB)
# More than this in use on the GPU at the executor's start is not its context alone (another process runs
# there): the estimate stands in for it.
MAX_CONTEXT_BYTES = 2 * GIB
LEAST_STEP = GIB // 16  # the least budget's resolution
MOST_BYTES = 16 * 1024 * GIB  # no budget beyond this is looked for


def budget_bytes(cfg: EngineConfig) -> int | None:
    """The budget in bytes, the context included; None: no budget (the GPU's free memory)."""
    gib = cfg.gpu_memory_gib
    return None if gib is None or gib == "auto" else int(float(gib) * GIB)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def planning_room(cfg: EngineConfig, free: int | None, context: int = CONTEXT_BYTES) -> tuple[int | None, str]:
    """The GPU bytes the sizes are planned for: `free` (free after the CUDA context; None: not known here)
    capped at the budget less `context`; and a note on where the figure comes from ("" without a budget)."""
    budget = budget_bytes(cfg)
    if budget is None:
        return free, ""
    room = budget - context
    said = f"{KEY} {budget / GIB:g} GiB less the CUDA context ({gib(context)})"
    if free is not None and free < room:
        return free, f"{said} is more than the GPU's {gib(free)} free: planned for the free memory"
    return room, f"{said}: {gib(room)}"


def sizes_of(cfg: EngineConfig) -> autosize.Sizes:
    """The sizes of an engine config whose `auto` sizes are resolved."""
    return autosize.Sizes(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(autosize.Sizes)})


def peak_bytes(model: Arch | ModelSpec, cfg: EngineConfig, batch: int, seq: int, sizes: autosize.Sizes) -> int:
    """The plan's GPU peak at these sizes (autosize.gpu_terms, summed)."""
    arch = autosize.as_arch(model)
    return sum(autosize.gpu_terms(arch, cfg, batch, seq, sizes).values())


def fitting(
    model: Arch | ModelSpec,
    cfg: EngineConfig,
    batch: int,
    seq: int,
    room: int,
    clip: bool,
    host_room: int | None = None,
    reserve: int = 0,
) -> autosize.Sizes | None:
    """The sizes chosen for `room` bytes (less `reserve`, what several executors keep beside the
    activations), where the plan's peak fits it; None where it does not."""
    arch = autosize.as_arch(model)
    try:
        sizes, _ = autosize.choose(arch, cfg, batch, seq, room - reserve, clip, host_room)
    except ResourceError:
        return None
    return sizes if peak_bytes(arch, cfg, batch, seq, sizes) + reserve <= room else None


def least_room(
    model: Arch | ModelSpec,
    cfg: EngineConfig,
    batch: int,
    seq: int,
    clip: bool,
    host_room: int | None = None,
    reserve: int = 0,
) -> int | None:
    """The least GPU memory beside the CUDA context (to LEAST_STEP) with which the run's plan fits; None where
    no memory does (explicit sizes the model cannot run with)."""
    arch = autosize.as_arch(model)
    if fitting(arch, cfg, batch, seq, MOST_BYTES, clip, host_room, reserve) is None:
        return None
    lo, hi = 0, MOST_BYTES // LEAST_STEP
    while lo < hi:
        mid = (lo + hi) // 2
        if fitting(arch, cfg, batch, seq, mid * LEAST_STEP, clip, host_room, reserve) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo * LEAST_STEP


def explicit_sizes(cfg: EngineConfig) -> list[str]:
    """The engine sizes the config sets (not `auto`), as key=value."""
    return [
        f"engine.{f.name}={getattr(cfg, f.name)}"
        for f in dataclasses.fields(autosize.Sizes)
        if getattr(cfg, f.name) != "auto"
    ]


def all_auto(cfg: EngineConfig) -> EngineConfig:
    return dataclasses.replace(cfg, **{f.name: "auto" for f in dataclasses.fields(autosize.Sizes)})


def budget_problem(
    model: Arch | ModelSpec, cfg: EngineConfig, batch: int, seq: int, clip: bool, reserve: int = 0
) -> str | None:
    """Why the budget cannot hold the run (its sizes planned for the budget less CONTEXT_BYTES), in a line;
    None where it can or there is no budget. `batch`: each executor's share; `reserve`: what several executors
    keep beside the activations."""
    arch = autosize.as_arch(model)
    budget = budget_bytes(cfg)
    if budget is None:
        return None
    room = budget - CONTEXT_BYTES
    if room > 0 and fitting(arch, cfg, batch, seq, room, clip, None, reserve) is not None:
        return None
    shape = f"{batch}x{seq} tokens per GPU"
    given = explicit_sizes(cfg)
    least = least_room(arch, all_auto(cfg), batch, seq, clip, None, reserve)
    if given:
        own = least_room(arch, cfg, batch, seq, clip, None, reserve)
        with_them = f"the least budget with them is {_budget(own)}" if own else "no budget holds them"
        auto = f"; with every size auto, {_budget(least)}" if least else ""
        return (
            f"{budget / GIB:g} GiB cannot hold the engine sizes set ({', '.join(given)}) at {shape}: "
            f"{with_them}{auto} (megatrain-launch plan CONFIG shows the plan)"
        )
    least_said = f"the least the plan computes is {_budget(least)}" if least else "no budget holds it"
    return (
        f"{budget / GIB:g} GiB is too small for this model at {shape} even at the smallest engine sizes: "
        f"{least_said}, the CUDA context included (megatrain-launch plan CONFIG shows the plan)"
    )


def _budget(room: int | None) -> str:
    """A least room as the budget that gives it (the context added), rounded up to a tenth of a GiB."""
    return f"{-(-((room or 0) + CONTEXT_BYTES) * 10 // GIB) / 10:g} GiB"


@dataclass(frozen=True)
class GpuCap:
    """The cap an executor (or a bench peer) set on its GPU: the budget, its CUDA context, the GPU's total."""

    budget: int
    context: int
    total: int

    @property
    def room(self) -> int:
        """What the caching allocator may reserve."""
        return self.budget - self.context

    def __str__(self) -> str:
        return (
            f"{KEY} {self.budget / GIB:g} GiB: PyTorch's caching allocator capped at {gib(self.room)} of the "
            f"GPU's {gib(self.total)} (the CUDA context takes {gib(self.context)})"
        )

    def oom(self, exc: BaseException, planned: int | None) -> str:
        """The one line for an out-of-memory error under the cap."""
        plan = f"; the plan's peak was {gib(planned)}" if planned else ""
        first = str(exc).split(". ")[0]
        return (
            f"out of GPU memory under {KEY} {self.budget / GIB:g} GiB (the allocator's cap {gib(self.room)}"
            f"{plan}): {first}; give {KEY} more or set smaller engine sizes (megatrain-launch plan CONFIG)"
        )


def cap_device(device, budget: int | None) -> GpuCap | None:
    """Cap this process's caching allocator on `device` at `budget` (bytes, the context included) less the
    context, measured now: before anything is allocated. Without a budget the cap is lifted (one process
    may run an executor after another's, in-process)."""
    import torch

    if budget is None:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        return None
    free, total = torch.cuda.mem_get_info(device)  # makes the context where none was yet
    used = total - free - torch.cuda.memory_reserved(device)
    context = used if 0 < used <= MAX_CONTEXT_BYTES else CONTEXT_BYTES
    cap = GpuCap(budget, context, total)
    if cap.room <= 0:
        raise ResourceError(f"{KEY} {budget / GIB:g} GiB does not even hold the CUDA context ({gib(context)})")
    torch.cuda.set_per_process_memory_fraction(min(cap.room / total, 1.0), device)
    return cap
