"""Typed errors. User mistakes are ValueError subclasses; everything the CLI prints is one of these."""

from __future__ import annotations


class MegatrainError(RuntimeError):
    """Base for errors that the launcher reports as one line without a traceback."""


class ConfigError(MegatrainError, ValueError):
    """A config key or value is wrong; the message names the key and, when known, file and line."""


class ResourceError(MegatrainError, ValueError):
    """Not enough memory (host RAM, /dev/shm, GPU); the message carries the numbers."""


class AbortError(MegatrainError):
    """A data-plane wait gave up because the run was aborted (a peer failed or the driver asked)."""


class WaitTimeout(MegatrainError):
    """A data-plane wait ran past its deadline: a peer is stuck or much slower than configured for."""


class LayoutMismatch(MegatrainError):
    """A shared-memory segment's header does not match what the attaching process expects."""


class ActorFailure(MegatrainError):
    """An actor died or raised; names the actor and carries the root cause."""

    def __init__(self, actor: str, cause: str, pid: int | None = None, died: bool = False, traceback: str = ""):
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
