"""Typed errors. User mistakes are ValueError subclasses; everything the CLI prints is one of these."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

# The errors whose message says all there is to say: raised in an actor, they are reported with their message
# alone (ActorFailure), not behind their class name.
SELF_EXPLAINED = ("ConfigError", "DataError", "ResourceError", "DiskFull")
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full filesystem, or the user's quota on it
STALLED = "stalled: "  # how the stall monitor's verdicts begin (ipc/protocol/monitor.py)


class MegatrainError(RuntimeError):
    """Base for errors that the launcher reports as one line without a traceback."""


class ConfigError(MegatrainError, ValueError):
    """A config key or value is wrong; the message names the key and, when known, file and line."""


class ResourceError(MegatrainError, ValueError):
    """Not enough memory (host RAM, /dev/shm, GPU); the message carries the numbers."""


class AbortError(MegatrainError):
    """A data-plane wait gave up because the run was aborted (a peer failed or the driver asked)."""


def is_stall_verdict(exc: BaseException) -> bool:
    """The stall monitor's verdict, come back as the abort of the run: it names the actor that stopped, which
    never answers, and no peer's answer can be a better root cause (they only waited on it). Whoever waits for
    the others' answers after it need not wait long."""
    return isinstance(exc, AbortError) and str(exc).removeprefix("run aborted: ").startswith(STALLED)


class WaitTimeout(MegatrainError):
    """A data-plane wait ran past its deadline: a peer is stuck or much slower than configured for."""


class LayoutMismatch(MegatrainError):
    """A shared-memory segment's header does not match what the attaching process expects."""


class ActorFailure(MegatrainError):
    """An actor died or raised; names the actor and carries the root cause."""

    def __init__(self, actor: str, cause: str, pid: int | None = None, died: bool = False, traceback: str = ""):
        name, sep, message = cause.partition(": ")
        cause = message if sep and name in SELF_EXPLAINED else cause
        self.actor, self.cause, self.pid, self.died = actor, cause, pid, died
        self.traceback = traceback  # the actor's own, where it raised (for error.log)
        where = f"actor '{actor}'" + (f" (pid {pid})" if pid else "")
        super().__init__(f"{where} failed: {cause}")


class DataError(MegatrainError, ValueError):
    """The training data cannot be used; the message names the file and line (or the config key)."""


class ProtocolError(MegatrainError):
    """A process left the data-plane protocol's plan (a unit out of order, a walk or role it does not know):
    a bug, reported by name instead of writing a gradient into the wrong tile."""


class NonFiniteGradient(MegatrainError):
    """A gradient piece was inf or NaN where the step cannot be skipped whole (no clipping)."""


class DiskFull(MegatrainError):
    """A write ran out of space; the message names the directory, the bytes it needed and what is free there."""


def free_bytes(path: str | Path) -> int:
    """Free bytes (for this user) on the filesystem of `path`, or of its nearest existing parent."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def human_bytes(n: float) -> str:
    """A byte count for a message: 512 B, 3.1 KiB, 20.0 MiB, 1.25 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


def disk_full(directory: str | Path, what: str, need: int | None = None, after: str = "") -> DiskFull:
    """The error for `what` (e.g. 'the checkpoint of step 40') not fitting in `directory`."""
    free = free_bytes(directory)
    needs = f" needs {human_bytes(need)};" if need else ""
    return DiskFull(
        f"no space left on the disk of {directory}: {what}{needs} {human_bytes(free)} free there"
        + (f" ({after})" if after else "")
    )


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE
