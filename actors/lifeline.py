"""A host's tie to its Ray node: the store owner ends its host's part of the run when the node's raylet is gone.

A Ray worker does not exit when its raylet dies (a crash, the OOM killer, a `kill -9`): the run's actors of that
node went on running, re-parented to init, holding the host's store in shared memory until the machine was
rebooted, while Ray itself marked the node dead only after its health checks ran out (~30-50 s). The store
owner watches the raylet that started it (Ray puts its pid in every worker's environment) and, once it is gone,
aborts the host's store (its workers stop, and serve() tells the driver why, if it still listens), ends the
host's workers by pid, unlinks the store and exits. Detection takes one poll (POLL_S).

A run whose actors share the driver's process (the in-process runner) has no node of its own to lose: nothing
is watched there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from megatrain.ipc.procs import live, start_ticks

RAYLET_ENV = "RAY_RAYLET_PID"  # set by Ray in every worker's environment
POLL_S = 0.2


def raylet() -> tuple[int, int] | None:
    """This process's raylet (pid, start ticks), where it runs in a Ray worker and the raylet is alive now."""
    try:
        pid = int(os.environ.get(RAYLET_ENV, ""))
    except ValueError:
        return None
    ticks = start_ticks(pid) if pid > 0 else 0
    return (pid, ticks) if ticks and live(pid, ticks) else None


class Lifeline:
    """Calls `lost(reason)` once, from a daemon thread of its own, when the raylet (pid, ticks) is gone."""

    def __init__(self, node: tuple[int, int], lost: Callable[[str], None]):
        self.node, self.lost = node, lost
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="lifeline", daemon=True)

    def start(self) -> Lifeline:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        pid, ticks = self.node
        while not self.stopped.wait(POLL_S):
            if not live(pid, ticks):  # dead, or a zombie its parent has not reaped yet: gone either way
                self.lost(f"its Ray node was lost (the node's raylet, pid {pid}, exited)")
                return
