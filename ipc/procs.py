"""Processes by pid: liveness (guarded against pid reuse), descendants, and detached watchdogs.

Import-light (no torch): the watchdogs that use it start in milliseconds. What the kernel knows about a
process (start time, state, parent, mappings) comes through psutil, not by parsing /proc here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil


def start_ticks(pid: int) -> int:
    """Process start time in clock ticks since boot (guards against pid reuse); 0 if unknown.

    Ticks, not psutil's float seconds: the value is stored in segment headers and compared exactly by other
    processes. psutil gives boot time + ticks / SC_CLK_TCK, and the boot time it adds (the kernel's btime,
    in whole seconds) can step while the wall clock is adjusted: it is read on both sides of the start time,
    and a read that straddles a step is taken again, so the ticks come back exact."""
    try:
        proc = psutil.Process(pid)
        for _ in range(3):
            before = psutil.boot_time()
            created = proc.create_time()
            if psutil.boot_time() == before:
                return max(0, round((created - before) * os.sysconf("SC_CLK_TCK")))
            proc = psutil.Process(pid)  # create_time() is cached per Process: read it again
    except (psutil.Error, OSError):
        pass
    return 0


def started_at(pid: int) -> float:
    """When the process started, in seconds since the epoch (time.time()'s clock); 0.0 if unknown. From its
    start ticks and the time since boot, to a tick: psutil's create_time() adds the boot time in whole
    seconds, up to a second early, which a start-up timed from it would count."""
    ticks = start_ticks(pid)
    if ticks and hasattr(time, "CLOCK_BOOTTIME"):  # the clock the kernel counts start ticks on
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return 0.0


def pid_alive(pid: int, ticks: int = 0) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not ticks or start_ticks(pid) in (0, ticks)


def live(pid: int, ticks: int = 0) -> bool:
    """The process (the one started at `ticks`, when given) exists and is not a zombie: a zombie has run all the
    code it ever will and its mappings are gone, and where nothing reaps it (a container whose first process
    is no init) it stays one for good."""
    return pid_alive(pid, ticks) and running(pid)


def running(pid: int) -> bool:
    """The process exists and is not a zombie (dead, not yet reaped by its parent)."""
    if not pid_alive(pid):
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False  # gone meanwhile
    except (psutil.Error, OSError):
        return True  # not readable (another user's): trust the signal check


def stopped(pid: int, ticks: int = 0) -> bool:
    """The process (the one started at `ticks`, when given) is stopped: by SIGSTOP, a terminal's Ctrl-Z or a
    debugger's trace. It runs no code until it is continued, so it answers nothing meanwhile."""
    if not pid_alive(pid, ticks):
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except (psutil.Error, OSError):
        return False


def descendants(roots: list[int]) -> list[int]:
    """Every process below `roots` in the process tree (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        ppid = proc.info["ppid"]
        if ppid is not None:  # None: it went away while being read
            children.setdefault(ppid, []).append(proc.pid)
    out, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def spawn_detached(module: str, *args: str) -> int:
    """Start `python -m module args` outside the caller's process tree (a double fork: re-parented to init,
    in its own session) and return its pid. A Ray worker's children are ended with the worker, and a
    driver's with the driver's session; a watchdog must outlive both."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatrain.ipc.procs", module, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        timeout=60,
    )
    return int(proc.stdout.strip())


def _detach(argv: list[str]) -> None:
    # stdout must not be the caller's pipe: that pipe only carries the pid, and must close now.
    child = subprocess.Popen(
        [sys.executable, "-m", *argv], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    print(child.pid, flush=True)


if __name__ == "__main__":
    _detach(sys.argv[1:])


def maps_path(pid: int, needle: str) -> bool:
    """Whether the process maps a file whose path contains `needle`: proof that a pid is still the
    process it was (a pid reused by another process does not map the run's segments)."""
    try:
        return any(needle in m.path for m in psutil.Process(pid).memory_maps(grouped=True))
    except (psutil.Error, OSError):
        return False
