"""What a run is doing, read from its control segment alone (read-only): `megatrain-launch status`.

Any process on the node can read it, with no StoreSpec and without attaching: the owner wrote the
run's description (role names by slot, pieces, model, output directory, steps) into ctl's about area
at creation; the role table holds each worker's heartbeat, calls and waits, and what it waits on; the
version counters say how many updates Adam has applied. Times in the role table are CLOCK_MONOTONIC,
one clock for every process of the host.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, field

from megatrain.ipc.procs import pid_alive, running
from megatrain.ipc.protocol import ctl
from megatrain.ipc.shared.segments import LIVE, Found, found
from megatrain.ipc.shared.shm import (
    HEADER_BYTES,
    LAYOUT_VERSION,
    MAGIC,
    MAX_PIDS,
    PREFIX,
    Header,
    pss_split,
    read_ctl,
    seg_name,
)


@dataclass
class Actor:
    role: str
    pid: int
    alive: bool
    beat_age_s: float  # since its last heartbeat
    state: str  # "idle", "working", "waiting"
    waiting_on: str = ""
    for_s: float = 0.0  # in that state (waiting: since the wait began; working: since the last progress)
    own_bytes: int = 0  # its memory outside the store (PSS)


@dataclass
class RunStatus:
    run_id: str
    owner_pid: int
    about: dict
    updates: int  # steps Adam has applied (the lowest version counter)
    shm_bytes: int  # the run's shared memory actually held (tmpfs blocks)
    actors: list[Actor] = field(default_factory=list)
    aborted: str = ""


def live_runs(shm_dir: str = "/dev/shm") -> tuple[list[RunStatus], list[Found]]:
    """The runs on this node whose owner is alive, and every other run id's shared memory, classified as
    `--cleanup` and a launch see it (ipc/shared/segments.py)."""
    runs, others = [], []
    for f in found(shm_dir):
        status = read_run(f.run_id, shm_dir) if f.kind == LIVE else None
        if status is None:
            others.append(f)
        else:
            status.shm_bytes = _held(shm_dir, list(f.entries))
            runs.append(status)
    return runs, others


def read_run(run_id: str, shm_dir: str = "/dev/shm") -> RunStatus | None:
    """The run's status; None if its control segment is gone, unreadable, of another layout, or its owner
    is dead."""
    try:
        size = os.stat(os.path.join(shm_dir, f"{PREFIX}{run_id}-ctl")).st_size
    except OSError:
        return None
    raw = read_ctl(run_id, 0, size, shm_dir) if size >= HEADER_BYTES + ctl.CTL_FIXED else None
    if raw is None:
        return None
    try:
        magic, version, hdr = Header.unpack(raw[:HEADER_BYTES])
    except (ValueError, struct.error):
        return None
    if magic != MAGIC or version != LAYOUT_VERSION or not pid_alive(hdr.owner_pid, hdr.owner_ticks):
        return None
    about = ctl.CtlView(raw, 0, HEADER_BYTES).read_about()
    pieces = int(about.get("pieces", 0))
    if size < HEADER_BYTES + ctl.ctl_bytes(pieces):
        return None
    view = ctl.CtlView(raw, pieces, HEADER_BYTES)
    updates = int(view.versions.min()) if pieces else 0
    status = RunStatus(
        run_id=run_id,
        owner_pid=hdr.owner_pid,
        about=about,
        updates=updates,
        shm_bytes=0,
        aborted=view.abort_reason() if view.aborted else "",
    )
    status.actors = _actors(view, about.get("roles", []), seg_name(run_id, ""))
    return status


def _actors(view: ctl.CtlView, roles: list[str], prefix: str) -> list[Actor]:
    now, out = time.monotonic(), []
    for slot, role in enumerate(roles[:MAX_PIDS]):
        pid = int(view.pids[slot])
        if pid <= 0:
            continue  # never attached (a packer of a resident run, the writer of a run that saves nothing)
        words, what = view.role_words[slot], view.waiting_on(slot)
        if words[ctl.WAITS] > 0:
            state, since = "waiting", now - words[ctl.WAIT_SINCE]
        elif words[ctl.CALLS] > 0:
            state, since = "working", now - words[ctl.PROGRESS]
        else:
            state, since = "idle", now - words[ctl.PROGRESS]
        out.append(
            Actor(
                role=role,
                pid=pid,
                alive=running(pid),
                beat_age_s=now - words[ctl.BEAT],
                state=state,
                waiting_on=what if state == "waiting" else "",
                for_s=since,
                own_bytes=pss_split(pid, prefix)[1],
            )
        )
    return out


def _held(shm_dir: str, entries: list[str]) -> int:
    total = 0
    for name in entries:
        try:
            total += os.stat(os.path.join(shm_dir, name)).st_blocks * 512
        except OSError:
            pass
    return total
