"""Watchdog started by the store owner: if the owner dies without unlinking, unlink for it.

A Ray actor killed with SIGKILL (ray.kill, a crashed job, the OOM killer, or the driver's death,
which takes its actors along) runs no cleanup code, so the owner starts this tiny process. It must
not be the owner's child: when a Ray worker exits, Ray ends the worker's child processes too,
whatever session they are in. So the owner starts it with a double fork
(megatrain.ipc.procs.spawn_detached), re-parented to init. It exits as soon as the owner has
unlinked the run's segments itself (normal shutdown) or right after cleaning up for a dead owner.
Usage: python -m megatrain.ipc.shared.reaper RUN_ID OWNER_PID OWNER_TICKS
"""

from __future__ import annotations

import os
import sys
import time

from megatrain.ipc.procs import live
from megatrain.ipc.shared.shm import PREFIX, remove_run, run_entries

POLL_S = 0.2


def watch(run_id: str, pid: int, ticks: int, shm_dir: str = "/dev/shm") -> list[str]:
    ctl = os.path.join(shm_dir, f"{PREFIX}{run_id}-ctl")
    while True:
        if not os.path.exists(ctl):
            return []  # the owner unlinked everything itself
        if not live(pid, ticks):  # dead, or a zombie nobody reaps: either ran its last cleanup code
            return remove_run(run_id, run_entries(shm_dir).get(run_id, []), shm_dir)
        time.sleep(POLL_S)


def main() -> None:
    run_id, pid, ticks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    removed = watch(run_id, pid, ticks)
    if removed:
        print(
            f"megatrain reaper: owner pid {pid} of run {run_id} died; removed {len(removed)} objects", file=sys.stderr
        )


if __name__ == "__main__":
    main()
