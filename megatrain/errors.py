"""Typed errors. User mistakes are ValueError subclasses; everything the CLI prints is one of these."""

from __future__ import annotations

import errno
import shutil
import time
from enum import IntEnum
from pathlib import Path

# The errors whose message says all there is to say: raised in an actor, they are reported with their message
# alone (ActorFailure), not behind their class name.
SELF_EXPLAINED = ("ConfigError", "DataError", "ResourceError", "DiskFull")
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full filesystem, or the user's quota on it
STALLED = "stalled: "  # how the stall monitor's verdicts begin (ipc/monitor.py)


class MegatrainError(RuntimeError):
    """Base for errors that the launcher reports as one line without a traceback."""


class ConfigError(MegatrainError, ValueError):
    """A config key or value is wrong; the message names the key and, when known, file and line."""


class ResourceError(MegatrainError, ValueError):
    """Not enough memory (host RAM, /dev/shm, GPU); the message carries the numbers."""


class Origin(IntEnum):
    """What raised a host's abort flag, the strongest first. Every watcher of a run (each host's stall monitor, each
    actor's guarded calls, the driver) may see a failure; the driver names the strongest it learnt of, of equals
    the earliest (launch/control/failures.py): a death before the failures it caused, wherever they were seen first."""

    DEATH = 1  # a process of the run is gone (the stall monitor saw it, or a call on it failed with its death)
    STALL = 2  # the stall monitor's verdict: a process stopped, or made no progress
    RAISE = 3  # an actor's own exception (a guarded call raised the flag as it failed)
    RELAY = 4  # the driver's abort of the run after a failure it learnt of elsewhere: a consequence, never a cause


class AbortError(MegatrainError):
    """A data-plane wait gave up because the run was aborted (a peer failed or the driver asked). `origin` and `at`
    (time.time()): what raised the flag and when, from the host's control segment."""

    def __init__(self, message: str, origin: int = Origin.RELAY, at: float = 0.0):
        super().__init__(message)
        try:
            self.origin = Origin(origin)
        except ValueError:  # 0: a flag raised without one (a control segment of an older run)
            self.origin = Origin.RELAY
        self.at = at


def is_stall_verdict(exc: BaseException) -> bool:
    """The stall monitor's verdict, come back as the abort of the run: it names the actor that stopped, which
    never answers, and no peer's answer can be a better root cause (they only waited on it). Whoever waits for
    the others' answers after it need not wait long."""
    if not isinstance(exc, AbortError):
        return False
    return exc.origin is Origin.STALL or str(exc).removeprefix("run aborted: ").startswith(STALLED)


class WaitTimeout(MegatrainError):
    """A data-plane wait ran past its deadline: a peer is stuck or much slower than configured for."""


class LayoutMismatch(MegatrainError):
    """A shared-memory segment's header does not match what the attaching process expects."""


class ActorFailure(MegatrainError):
    """An actor died or raised; names the actor (with its pid, and its node over several hosts) and carries the
    root cause. `at` (time.time()): when it raised (the actor's own clock, RAISED_AT), or when its death was seen."""

    def __init__(
        self,
        actor: str,
        cause: str,
        pid: int | None = None,
        died: bool = False,
        traceback: str = "",
        node: str = "",
        at: float | None = None,
    ):
        name, sep, message = cause.partition(": ")
        cause = message if sep and name in SELF_EXPLAINED else cause
        self.actor, self.cause, self.pid, self.died, self.node = actor, cause, pid, died, node
        self.traceback = traceback  # the actor's own, where it raised (for error.log)
        self.at = time.time() if at is None else at
        about = [f"pid {pid}"] * bool(pid) + [f"node {node}"] * bool(node)
        where = f"actor '{actor}'" + (f" ({', '.join(about)})" if about else "")
        super().__init__(f"{where} failed: {cause}")

    @property
    def origin(self) -> Origin:
        return Origin.DEATH if self.died else Origin.RAISE

    def named(self, actor: str, pid: int | None, node: str) -> ActorFailure:
        """The same failure under the name, pid and node the driver knows the actor by."""
        return ActorFailure(actor, self.cause, pid or self.pid, self.died, self.traceback, node, self.at)


# Set by an actor's guarded call on the exception it raises (time.time()): the driver orders failures by when
# they happened, not by when their answers reached it.
RAISED_AT = "megatrain_raised_at"


def raised_at(exc: BaseException) -> float | None:
    return getattr(exc, RAISED_AT, None)


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
