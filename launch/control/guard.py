"""Watchdog of a locally started Ray instance (launch/control/cluster.py starts both): if the driver dies
without shutting Ray down (SIGKILL, the OOM killer), end every process of that instance.

ray.init starts the head processes (GCS, raylet) as the driver's children and the workers as the
raylet's; killed with the driver, the raylet leaves its agents and workers orphaned for minutes. The
guard is detached from the driver's process tree (megatrain.ipc.procs.spawn_detached), follows the
instance's process tree while the driver lives, and kills exactly the processes it saw (pid and start
time), never anything by name. The store owner's reaper then unlinks the run's shared memory. On a
normal exit the driver stops the guard with SIGTERM after ray.shutdown(); it then ends whatever of
the instance still lingers.
Usage: python -m megatrain.launch.control.guard DRIVER_PID DRIVER_TICKS ROOT_PID...
"""

from __future__ import annotations

import os
import signal
import sys
import time

from megatrain.ipc.procs import descendants, pid_alive, start_ticks

POLL_S = 0.5


class Guard:
    def __init__(self, driver: int, ticks: int, roots: list[int]):
        self.driver, self.ticks = driver, ticks
        self.tracked = {pid: start_ticks(pid) for pid in roots}
        self.stopping = False

    def follow(self) -> None:
        """Track new processes of the instance (workers start on demand) until the driver is gone. Not one
        that leads a session of its own: that one was detached on purpose to outlive the instance (the
        store owner's reaper, which unlinks the run's shared memory after the owner's death). Caught in
        the moment between its start and its re-parenting to init, it was ended with the instance, and
        the run's shared memory stayed behind."""
        while not self.stopping and pid_alive(self.driver, self.ticks):
            for pid in descendants(list(self.tracked)):
                if pid not in self.tracked and not _detached(pid):
                    self.tracked[pid] = start_ticks(pid)
            time.sleep(POLL_S)

    def end_all(self) -> list[int]:
        killed = []
        for pid, ticks in self.tracked.items():
            # ticks 0: gone before its start was read, and its pid may be another process's by now
            if pid != self.driver and ticks and pid_alive(pid, ticks):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        return killed


def _detached(pid: int) -> bool:
    """Whether the process leads its own session (started with setsid: spawn_detached's processes do)."""
    try:
        return os.getsid(pid) == pid
    except OSError:  # gone
        return False


def main() -> None:
    guard = Guard(int(sys.argv[1]), int(sys.argv[2]), [int(p) for p in sys.argv[3:]])

    def stop(*_: object) -> None:
        guard.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal that started the driver may go first
    guard.follow()
    if not guard.stopping:
        time.sleep(POLL_S)  # let Ray's own fate sharing go first
    killed = guard.end_all()
    if killed and not guard.stopping:
        print(
            f"megatrain guard: driver pid {guard.driver} died; ended {len(killed)} processes of its Ray instance",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
