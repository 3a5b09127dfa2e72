"""`megatrain-launch status`: the runs alive on this node, from their control segments.

For each: run id, owner, model, steps applied of the total, output directory, the shared memory held,
and every actor with its pid, role, what it is doing or waiting on, and its own memory (PSS outside
the store). The pids are the ones to attach a profiler to (py-spy, nsys; see the README). Then every
other run id's shared memory, classified (ipc/segments.py): what it is, and whether `--cleanup` removes it.
"""

from __future__ import annotations

import argparse
import time

from megatrain.ipc.protocol.status import Actor, RunStatus, live_runs
from megatrain.ipc.shm import gib
from megatrain.launch.report.progress import clock


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="megatrain-launch status",
        description="List the MegaTrain runs alive on this node and what each actor does.",
    )
    p.add_argument("--shm-dir", default="/dev/shm", help="where the runs' shared memory lives (ipc.shm_dir)")
    args = p.parse_args(argv)
    runs, others = live_runs(args.shm_dir)
    if not runs:
        print("no runs")
    for run in runs:
        print(describe(run))
    for f in others:  # in the words --cleanup and a launch naming that run id use
        print(f.line())
    return 0


def describe(run: RunStatus) -> str:
    a = run.about
    steps = f"step {run.updates}" + (f" of {a['steps']}" if "steps" in a else "")
    lines = [
        f"run {run.run_id}: {steps} applied, up {clock(time.time() - a.get('created', time.time()))}, "
        f"owner pid {run.owner_pid}" + (f"; ABORTED: {run.aborted}" if run.aborted else ""),
        f"  model {a.get('family', '?')}, {a.get('layers', '?')} layers, {a.get('params', 0) / 1e6:.2f}M params; "
        f"staging {a.get('staging', '?')}; clipping {'on' if a.get('clip') else 'off'}",
        f"  output {a.get('output_dir', '?')}",
        f"  shared memory held {gib(run.shm_bytes)}",
        f"  {'role':<22} {'pid':>8}  {'own memory':>10}  state",
    ]
    lines += [f"  {x.role:<22} {x.pid:>8}  {gib(x.own_bytes):>10}  {_state(x)}" for x in run.actors]
    return "\n".join(lines)


def _state(x: Actor) -> str:
    if not x.alive:
        return "GONE (its process is dead)"
    beat = f"; no heartbeat for {x.beat_age_s:.0f} s (stopped?)" if x.beat_age_s > 5 else ""
    if x.state == "waiting":
        return f"waiting {x.for_s:.2f} s for {x.waiting_on}{beat}"
    if x.state == "working":
        return f"working (in a call; last progress {x.for_s:.2f} s ago){beat}"
    return f"idle (between calls){beat}"
