"""What the launcher says about a run on the console, beside the progress of its steps
(launch/report/progress.py): the start-up summary, a config value on one line, a profiled step's verdict
and the host memory after the last step."""

from __future__ import annotations

import json
from typing import Any

from megatrain import log
from megatrain.ipc.cpus import describe as describe_cpu_plan
from megatrain.ipc.messages import HostMemory
from megatrain.ipc.protocol import StoreSpec
from megatrain.ipc.shared.shm import gib


def log_profile(row: dict, cuda: bool) -> None:
    """The executor's verdict on a profiled step (train.profile), on one line."""
    where = f"profiled step {row['step']} into {row['profile_trace']} (on the executor's node)"
    if "profile_error" in row:
        log(f"{where}, but the check failed: {row['profile_error']}")
        return
    verdict = (
        "inconclusive: no CUDA runtime call was attributed to the compute thread"
        if cuda and not row["loop_runtime_calls"]
        else f"{row['loop_blocking_calls']} host-blocking CUDA calls on the compute thread inside the layer "
        f"loop {row['loop_blocking_names']} (of {row['loop_runtime_calls']} runtime calls there)"
    )
    log(f"{where}: {verdict}; {row['helper_thread_blocking_calls']} on the copy threads (slab hand-offs)")


def short(value: Any) -> str:
    """A config value on one console line."""
    return json.dumps(value) if isinstance(value, (dict, list, tuple)) else str(value)


def describe_run(
    spec: StoreSpec, device: str, dtype: str, pids: dict[str, int], roles: list[str], inprocess: bool
) -> None:
    """The start-up summary: model, host store, actors and the node's CPU plan."""
    parts = spec.part_bytes()
    n = spec.layout.num_params
    log(
        f"model: {spec.model.family}, {spec.layout.num_layers} layers, {n / 1e6:.2f}M params, "
        f"tied={spec.layout.tied}; executor on {device} ({dtype})"
    )
    log(
        f"host store: {gib(sum(parts.values()))} in shared memory = {sum(parts.values()) / n:.2f} bytes/param "
        f"({', '.join(f'{k} {gib(v)}' for k, v in parts.items())})"
    )
    log("actors: " + ", ".join(f"{k} pid {v}" for k, v in pids.items()))
    log(
        describe_cpu_plan(spec.threads, spec.cores, roles)
        + (
            "; in one process (launch.runner=inprocess): torch's count is shared, left at its default"
            if inprocess
            else ""
        )
    )


def describe_memory(mem: HostMemory, num_params: int) -> None:
    """The run's host memory (StoreOwner.host_memory) after the last step."""
    log(
        f"host memory of the run's {mem.processes} processes (PSS): {gib(mem.pss_bytes)}, "
        f"{mem.pss_bytes / num_params:.2f} bytes per parameter; outside the store: "
        + ", ".join(f"{r} {gib(b)}" for r, b in mem.pss_own_by_role.items())
    )
