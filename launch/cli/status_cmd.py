"""`megatrain-launch status`: the runs alive on this node, from their control segments.

For each: run id, owner, model, steps applied of the total, output directory, the shared memory held,
and every actor with its pid, role, what it is doing or waiting on, and its own memory (PSS outside
the store). The pids are the ones to attach a profiler to (py-spy, nsys; see the README). Then every
other run id's shared memory, classified (ipc/shared/segments.py): what it is, and whether `--cleanup` removes it.
"""

from __future__ import annotations

import argparse
import os
import time

from megatrain.errors import ConfigError
from megatrain.ipc.shared.shm import gib
from megatrain.ipc.status import Actor, RunStatus, live_runs
from megatrain.launch.report.progress import clock
from megatrain.roster import on_host


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="megatrain-launch status",
        description="List the MegaTrain runs alive on this node and what each actor does.",
    )
    p.add_argument("--shm-dir", default="/dev/shm", help="where the runs' shared memory lives (ipc.shm_dir)")
    args = p.parse_args(argv)
    runs, others = live_runs(shm_dir_arg(args.shm_dir))
    if not runs:
        print("no runs")
    for stores in by_run(runs):
        print(describe(stores))
    for f in others:  # in the words --cleanup and a launch naming that run id use
        print(f.line())
    return 0


def shm_dir_arg(path: str) -> str:
    """`--shm-dir`'s directory, or a ConfigError naming the option and the path (a mistyped one would otherwise
    read as "no runs", or remove nothing, without a word)."""
    if not os.path.exists(path):
        raise ConfigError(f"--shm-dir {path}: no such directory")
    if not os.path.isdir(path):
        raise ConfigError(f"--shm-dir {path}: not a directory")
    return path


def by_run(stores: list[RunStatus]) -> list[list[RunStatus]]:
    """The stores on this node by run: a run over several hosts has one store per host (host h's under its own
    run id, megatrain/ipc/shm.py host_run_id), each saying its run and host in its description; host order."""
    runs: dict[str, list[RunStatus]] = {}
    for store in stores:
        runs.setdefault(store.about.get("run", store.run_id), []).append(store)
    return [sorted(group, key=lambda s: s.about.get("host", 0)) for group in runs.values()]


def describe(stores: list[RunStatus]) -> str:
    """A run's stores on this node (one, or one per host of it here), host 0's first where it is here."""
    first = stores[0]
    a = first.about
    run_id, hosts = a.get("run", first.run_id), a.get("hosts", 1)
    steps = f"step {first.updates}" + (f" of {a['steps']}" if "steps" in a else "")
    here = ", ".join(str(s.about.get("host", 0)) for s in stores)
    over = f"; over {hosts} hosts, host{'s' if len(stores) > 1 else ''} {here} on this node" if hosts > 1 else ""
    lines = [
        f"run {run_id}: {steps} applied, up {clock(time.time() - a.get('created', time.time()))}"
        + (over or f", owner pid {first.owner_pid}")
        + (f"; ABORTED: {first.aborted}" if first.aborted and hosts == 1 else ""),
        f"  model {a.get('family', '?')}, {a.get('layers', '?')} layers, {a.get('params', 0) / 1e6:.2f}M params; "
        f"staging {a.get('staging', '?')}; clipping {'on' if a.get('clip') else 'off'}",
        f"  output {a.get('output_dir', '?')}",
    ]
    for store in stores:
        lines += _host(store) if hosts > 1 else _actors(store)
    return "\n".join(lines)


def _host(store: RunStatus) -> list[str]:
    """One host's store of a run over several hosts: its own heading, then its actors named ROLE@hostH."""
    host = store.about.get("host", 0)
    return [
        f"  host {host}: store {store.run_id}, owner pid {store.owner_pid}, step {store.updates} applied"
        + (f"; ABORTED: {store.aborted}" if store.aborted else ""),
        *_actors(store, host),
    ]


def _actors(run: RunStatus, host: int = 0) -> list[str]:
    lines = [
        f"  shared memory held {gib(run.shm_bytes)}",
        f"  {'role':<22} {'pid':>8}  {'own memory':>10}  state",
    ]
    lines += [f"  {on_host(x.role, host):<22} {x.pid:>8}  {gib(x.own_bytes):>10}  {_state(x)}" for x in run.actors]
    return lines


def _state(x: Actor) -> str:
    if not x.alive:
        return "GONE (its process is dead)"
    beat = f"; no heartbeat for {x.beat_age_s:.0f} s (stopped?)" if x.beat_age_s > 5 else ""
    if x.state == "waiting":
        return f"waiting {x.for_s:.2f} s for {x.waiting_on}{beat}"
    if x.state == "working":
        return f"working (in a call; last progress {x.for_s:.2f} s ago){beat}"
    return f"idle (between calls){beat}"
