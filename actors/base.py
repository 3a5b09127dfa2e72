"""What every actor shares: a name, its pid, and abort-on-error so peers stop waiting at once."""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from megatrain.errors import RAISED_AT, AbortError, Origin
from megatrain.ipc.messages import ActorInfo
from megatrain.ipc.procs import started_at
from megatrain.ipc.protocol import StoreSpec

F = TypeVar("F", bound=Callable[..., Any])


def guarded(fn: F) -> F:
    """Any failure inside a data-plane method raises the shared abort flag before propagating."""

    @functools.wraps(fn)
    def wrapper(self: Role, *args: Any, **kwargs: Any) -> Any:
        self.use_threads()  # on every call's thread: Ray runs calls on threads other than the constructor's
        store = self.store
        if store is not None:
            store.call_started()  # the stall monitor counts from here
        try:
            return fn(self, *args, **kwargs)
        except AbortError:
            raise
        except BaseException as exc:
            _stamp(exc)
            if store is not None:
                store.abort(f"{store.label(self.name)}: {type(exc).__name__}: {exc}", Origin.RAISE)
            raise
        finally:
            if store is not None:
                store.call_ended()

    return wrapper  # type: ignore[return-value]


def _stamp(exc: BaseException) -> None:
    """When the actor raised, on the exception itself (it travels to the driver with it): the driver names the
    earliest failure, not the first answer to reach it."""
    try:
        setattr(exc, RAISED_AT, time.time())
    except AttributeError:  # an exception type that takes no attributes: the driver's clock stands in
        pass


class Role:
    """Base of the actor classes. Plain Python objects: Ray wraps them, tests may use them directly."""

    def __init__(self, name: str):
        # Start-up timeline (time.time()): the process's start, then what the role marks; the driver logs it.
        self.marks = {"process": started_at(os.getpid()), "init": time.time()}
        self.name = name
        self.store: Any = None
        self.events: list | None = None
        self.numba_threads = 0  # 0: Numba's default (all cores); set from the node's CPU plan at attach
        self.shared_process = False  # the in-process runner: every role in one process (tests)
        self.observed: dict[str, int] = {}  # the thread counts the last data-plane call ran with

    def apply_threads(self, spec: StoreSpec) -> None:
        """Take this role's thread counts from the CPU plan in the spec (ipc/cpus.py). torch's
        count is process-wide: set here, unless every role shares this process (then it stays torch's
        default, all cores); Numba's is per thread: set on each call's thread by use_threads()."""
        mine = spec.threads.get(self.name)
        if mine is None:
            return
        self.numba_threads = mine.numba
        if not self.shared_process:
            import torch

            torch.set_num_threads(mine.torch)
        self.use_threads()

    def use_threads(self) -> None:
        """Apply the role's Numba thread count on the calling thread and record what this call runs with
        (thread_counts() reports it: the check that the plan is what the work really gets)."""
        import numba
        import torch

        if self.numba_threads > 0:
            numba.set_num_threads(min(self.numba_threads, numba.config.NUMBA_NUM_THREADS))
        self.observed = {"torch": torch.get_num_threads(), "numba": numba.get_num_threads()}

    def thread_counts(self) -> dict[str, int]:
        return self.observed

    def open_events(self, handles: list[bytes]) -> None:
        """Open the executor's interprocess events of the gradient slabs (workers that drain them)."""
        import torch

        from megatrain.ipc.cuda_events import open_ipc_events

        self.events = open_ipc_events(handles, torch.device("cuda", torch.cuda.current_device()))

    def profile_start(self, path: str) -> str:
        """Sample this actor's process with py-spy into `path` (speedscope) until profile_stop; '' or why not."""
        from megatrain.ipc.sampler import Sampler

        self.sampler = Sampler()
        return self.sampler.start(path)

    def profile_stop(self) -> str:
        sampler = getattr(self, "sampler", None)
        return sampler.stop() if sampler is not None else "no sampler was running"

    def mark(self, what: str) -> None:
        """Record when a start-up stage of this role ended (its start-up timeline, in info())."""
        self.marks[what] = time.time()

    def info(self) -> ActorInfo:
        return ActorInfo(name=self.name, pid=os.getpid(), host=socket.gethostname(), marks=dict(self.marks))

    def abort(self, reason: str) -> None:
        """The driver's abort of the run, after a failure it learnt of (a consequence here, never the cause).
        Callable while a step is blocked (actors run with max_concurrency=3: Adam may hold two overlapping steps)."""
        if self.store is not None:
            self.store.abort(reason, Origin.RELAY)
