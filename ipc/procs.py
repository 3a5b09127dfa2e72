"""Processes by pid: liveness (guarded against pid reuse), descendants, and detached watchdogs.

Import-light (no torch): the watchdogs that use it start in milliseconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def start_ticks(pid: int) -> int:
    """Process start time in clock ticks since boot (guards against pid reuse); 0 if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def started_at(pid: int) -> float:
    """When the process started, in seconds since the epoch (time.time()'s clock); 0.0 if unknown."""
    ticks = start_ticks(pid)
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return 0.0
    return boot + ticks / os.sysconf("SC_CLK_TCK") if ticks else 0.0


def pid_alive(pid: int, ticks: int = 0) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not ticks or start_ticks(pid) in (0, ticks)


def running(pid: int) -> bool:
    """The process exists and is not a zombie (dead, not yet reaped by its parent)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return not os.path.isdir("/proc/self")  # gone meanwhile, or no /proc: trust the signal check


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def descendants(roots: list[int]) -> list[int]:
    """Every process below `roots` in the process tree (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
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
    proc = subprocess.run([sys.executable, "-m", "megatrain.ipc.procs", module, *args], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, text=True, check=True, timeout=60)
    return int(proc.stdout.strip())


def _detach(argv: list[str]) -> None:
    # stdout must not be the caller's pipe: that pipe only carries the pid, and must close now.
    child = subprocess.Popen([sys.executable, "-m", *argv], start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL)
    print(child.pid, flush=True)


if __name__ == "__main__":
    _detach(sys.argv[1:])


def maps_path(pid: int, needle: str) -> bool:
    """Whether the process maps a file whose path contains `needle`: proof that a pid is still the
    process it was (a pid reused by another process does not map the run's segments)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(needle in line for line in f)
    except OSError:
        return False
