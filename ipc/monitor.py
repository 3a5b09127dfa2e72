"""Stall detection from the role table: which actor stopped, not which one is waiting on it.

First, and at once: while a step is in flight, a worker whose process is gone is named as dead. The
driver learns of a death from a failed call, but an actor that dies between its calls fails none, and
its peers would only wait on it until the stall timeout.

A step in flight always makes progress somewhere within a fraction of a second (a slab filled, a
gradient drained, a version published). When none has been made by any actor for ipc.stall_timeout_s
while some driver call is in flight, the run is stalled, and the culprit is, in this order:
  1. an actor whose process stopped beating (SIGSTOP, a frozen host process, C code holding the GIL);
  2. an actor inside a call that is not waiting on the data plane (stuck in its own work: a deadlock,
     a hung kernel, or a layer slower than the timeout);
  3. otherwise everyone waits on someone: the waits are listed.
Between calls nothing is owed, with one exception: a worker whose process stopped beating. The driver
may be waiting on it although no worker is inside a call: on a call it never started, or on the reply
to one it ended just before it stopped (seen: SIGSTOP between an update's last version and its reply,
after which every other call of the step could finish). It is named once its heartbeat is older than
both the stale-beat limit and ipc.stall_timeout_s; a live idle worker beats every second.
The store owner runs the monitor; it raises the abort flag with the verdict, so every waiter stops and
the driver reports the verdict.
"""

from __future__ import annotations

import socket
import threading
import time

from megatrain.errors import Origin
from megatrain.ipc.procs import running
from megatrain.ipc.protocol.store import BEAT, BEAT_S, CALLS, PROGRESS, WAITS, Store

STALE_BEATS = 5  # heartbeats missed before a process counts as stopped


def find_stall(store: Store, timeout: float, now: float | None = None) -> str | None:
    """The verdict if the run is stalled, else None."""
    found = find_verdict(store, timeout, now)
    return found[0] if found else None


def find_verdict(store: Store, timeout: float, now: float | None = None) -> tuple[str, Origin] | None:
    """The verdict and what it is (a death, or a stall) if the run is stalled, else None."""
    now = time.monotonic() if now is None else now
    rows = [
        (role, slot, store.role_words[slot]) for slot, role in enumerate(store.spec.roles()) if store.pids[slot] > 0
    ]
    if not rows:
        return None
    if not any(row[CALLS] > 0 for _, _, row in rows):  # a frozen worker only: see the module's docstring
        stopped = _stopped(store, rows, now, max(STALE_BEATS * BEAT_S, timeout))
        if not stopped:
            return None
        return f"{stopped} while no worker was inside a call; the driver waits on it", Origin.STALL
    gone = [(role, slot) for role, slot, _ in rows if not running(int(store.pids[slot]))]
    if gone:  # at once: a worker that is idle when it dies fails no call the driver waits on
        role, slot = gone[0]
        return (
            f"{who(store, role, slot)} died: its process is gone (killed, or crashed in native code) while the run "
            "was in a step",
            Origin.DEATH,
        )
    idle = now - max(row[PROGRESS] for _, _, row in rows)
    if idle < timeout:
        return None

    waits = "; ".join(
        f"{store.label(role)} waits for {store.waiting_on(slot)}" for role, slot, row in rows if row[WAITS] > 0
    )
    waiting = f" ({waits})" if waits else ""
    stopped = _stopped(store, rows, now, STALE_BEATS * BEAT_S)
    if stopped:
        return f"{stopped}; no progress anywhere for {idle:.0f}s{waiting}", Origin.STALL
    working = [(role, slot, row) for role, slot, row in rows if row[CALLS] > 0 and row[WAITS] == 0]
    if working:
        role, slot, row = min(working, key=lambda r: r[2][PROGRESS])
        return (
            f"stalled: {who(store, role, slot)} made no progress for {now - row[PROGRESS]:.0f}s while working (not "
            f"waiting on any peer){waiting}; if one unit legitimately takes this long, raise "
            f"ipc.stall_timeout_s",
            Origin.STALL,
        )
    return f"stalled: no progress anywhere for {idle:.0f}s, every actor in a call is waiting{waiting}", Origin.STALL


def who(store: Store, role: str, slot: int) -> str:
    """A worker of this store as a verdict names it: with its pid, and over several hosts with its host and node."""
    node = f", node {socket.gethostname()}" if store.spec.hosts > 1 else ""
    return f"actor '{store.label(role)}' (pid {int(store.pids[slot])}{node})"


def _stopped(store: Store, rows: list, now: float, limit: float) -> str | None:
    """The worker whose process exists but has not beaten for longest, beyond `limit` seconds; None if none."""
    quiet = [
        (role, slot, now - row[BEAT])
        for role, slot, row in rows
        if now - row[BEAT] > limit and running(int(store.pids[slot]))
    ]
    if not quiet:
        return None
    role, slot, age = max(quiet, key=lambda r: r[2])
    return (
        f"stalled: {who(store, role, slot)} stopped running (no heartbeat for {age:.0f}s: stopped, frozen, or stuck "
        "in native code)"
    )


class Monitor:
    """A thread of the store owner: checks once a second for a dead worker or a stall, and aborts the run
    on either."""

    def __init__(self, store: Store):
        self.store = store
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="stall-monitor", daemon=True)

    def start(self) -> Monitor:
        if self.store.spec.ipc.stall_seconds() > 0:
            self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(BEAT_S):
            if self.store.aborted:
                continue
            found = find_verdict(self.store, self.store.spec.ipc.stall_seconds())
            if found:
                verdict, origin = found
                print(f"[{self.store.label('store-owner')}] {verdict}", flush=True)
                self.store.abort(verdict, origin)

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(5)
