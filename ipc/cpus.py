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
An explicit actors.*_threads value replaces the rule for its role. Each role's rule is in its roster row
(megatrain/roster.py ThreadRule); the numbers are worked out here, by the store owner, on the node the roles share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatrain.roster import Kind, Roster, ThreadRule


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
    cores: int, roster: Roster, request: ThreadRequest | None = None, numba_max: int = 0
) -> dict[str, Threads]:
    """Per role of the roster, its thread counts by its row's rule. `numba_max`: Numba's pool size
    (NUMBA_NUM_THREADS, fixed when Numba loads); no role may ask for more."""
    c, request = max(cores, 1), request or ThreadRequest()
    plan = {r.name: _threads(r.threads, c, roster, request) for r in roster.roles}
    if numba_max:
        plan = {r: Threads(t.torch, min(t.numba, numba_max)) for r, t in plan.items()}
    return plan


def _threads(rule: ThreadRule, c: int, roster: Roster, request: ThreadRequest) -> Threads:
    """One role's threads on a node of `c` cores (the rules of this module's docstring)."""
    if rule is ThreadRule.ALL:
        return Threads(c, c)
    if rule is ThreadRule.UPDATER:
        return Threads(request.adam or c, request.adam or c)
    if rule is ThreadRule.EXECUTOR:
        split = max(1, c // max(roster.count(Kind.EXECUTOR), 1))
        n = request.executor or (min(2, c) if roster.cuda else split)
        return Threads(n, 1 if roster.cuda else n)
    if rule is ThreadRule.PACKER:
        return Threads(request.packer or max(1, c // 2 // max(roster.count(Kind.PACKER), 1)), 1)
    if rule is ThreadRule.ACCUMULATOR:
        return Threads(1, request.accumulator or max(1, c // max(roster.count(Kind.ACCUMULATOR), 1)))
    if rule is ThreadRule.ONE:
        return Threads(1, 1)
    raise ValueError(f"no thread rule {rule}")


def describe(plan: dict[str, Threads], cores: int, roles: list[str]) -> str:
    """One line for the log: the roles this run has, in order, with torch/Numba threads."""
    return f"CPU plan ({cores} cores on the store's node; torch/Numba threads): " + ", ".join(
        f"{r} {plan[r].torch}/{plan[r].numba}" for r in roles if r in plan
    )
