"""The node's CPU plan: how many torch and Numba threads each role runs with.

Every process of a run sets both counts from this plan, explicitly, never from what Ray or the
environment left behind: Ray sets OMP_NUM_THREADS to an actor's CPU request (1), under which torch runs
single-threaded, and that once made the resident copy's fp32 -> bf16 cast the slowest part of a step.

Who runs at the same time decides the split (C = the cores this node lets the store owner use):
  * the Adam updater is on the critical path (the next forward waits for each unit's update), and it
    runs beside the packers only: it gets all C, for its Numba kernel and for the resident cast;
  * the packers run beside Adam (forward) and the accumulators (backward): together half the cores;
  * the accumulators run during the backward, while Adam waits for the gradients (with clipping),
    one after the other through the slabs: C split between them;
  * the executor on CUDA only launches work and copies: 2 threads; on the CPU device it is the compute,
    and gets all C;
  * the store owner fills the store before any step (init, a pretrained import, a resume): all C;
  * the checkpoint writer's work is its own I/O threads (actors.writer_threads): 1 each.
An explicit actors.*_threads value replaces the rule for its role.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Threads:
    torch: int
    numba: int


@dataclass(frozen=True)
class ThreadRequest:
    """The actors.*_threads config values; 0 = by the plan's rule."""

    executor: int = 0
    adam: int = 0
    packer: int = 0
    accumulator: int = 0


def node_cores() -> int:
    """The cores this process may run on (its affinity mask: a container or taskset may allow fewer
    than the machine has)."""
    return len(os.sched_getaffinity(0))


def cpu_plan(
    cores: int,
    cuda: bool,
    num_packers: int,
    num_accumulators: int,
    request: ThreadRequest | None = None,
    numba_max: int = 0,
    executors: int = 1,
) -> dict[str, Threads]:
    """Per role name (the names of StoreSpec.roles() and the store owner), its thread counts. `numba_max`:
    Numba's pool size (NUMBA_NUM_THREADS, fixed when Numba loads); no role may ask for more."""
    c, request = max(cores, 1), request or ThreadRequest()
    executor = request.executor or (min(2, c) if cuda else max(1, c // max(executors, 1)))
    adam = request.adam or c
    packer = request.packer or max(1, c // 2 // max(num_packers, 1))
    accumulator = request.accumulator or max(1, c // max(num_accumulators, 1))
    plan = {
        "store-owner": Threads(c, c),
        "gpu-executor": Threads(executor, 1 if cuda else executor),
        **{f"gpu-executor-{r}": Threads(executor, 1 if cuda else executor) for r in range(1, executors)},
        "adam-updater": Threads(adam, adam),
        "checkpoint-writer": Threads(1, 1),
    }
    plan.update({f"packer-{i}": Threads(packer, 1) for i in range(num_packers)})
    plan.update({f"grad-accumulator-{i}": Threads(1, accumulator) for i in range(num_accumulators)})
    if numba_max:
        plan = {r: Threads(t.torch, min(t.numba, numba_max)) for r, t in plan.items()}
    return plan


def describe(plan: dict[str, Threads], cores: int, roles: list[str]) -> str:
    """One line for the log: the roles this run has, in order, with torch/Numba threads."""
    return f"CPU plan ({cores} cores on the store's node; torch/Numba threads): " + ", ".join(
        f"{r} {plan[r].torch}/{plan[r].numba}" for r in roles if r in plan
    )
