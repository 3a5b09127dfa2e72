"""The run's actors as the driver sees them: spawning and ending them, calling them, and waiting for the
calls with the run's failure handling (the first real failure is the one reported, never its victims)."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from megatrain.actors.base import Role
from megatrain.actors.store_owner import StoreOwner
from megatrain.errors import AbortError, ActorFailure, MegatrainError, is_stall_verdict
from megatrain.ipc.procs import live, start_ticks
from megatrain.ipc.protocol.messages import ActorInfo
from megatrain.launch.control.handles import Handle, Pending, Runner
from megatrain.launch.control.placement import Demand
from megatrain.roster import OWNER, Kind, Roster, kind_of, on_host, split_host

P = ParamSpec("P")
R = TypeVar("R")
SHUTDOWN_S = 15.0
# How long the end of a run waits for its actors' processes on this node to exit once they were ended: the store's
# memory is the system's again only when the last process that maps it is gone, and the caller's next run (a bench's
# next row, a notebook's next Trainer) plans against what is free. Ray's kill reaches a frozen process in ~5 s.
GONE_S = 30.0


class Crew:
    """The actors by name, their pids and start-up marks once attached, and each store owner's serve() call,
    held open for the run's life: it ends (fails) when the owner dies or the run is aborted. Over several
    hosts every host has its own actors (named by megatrain/roster.py on_host) and its own store."""

    def __init__(self, runner: Runner, setup_timeout_s: float):
        self.runner, self.setup_timeout_s = runner, setup_timeout_s
        self.actors: dict[str, Handle[Any]] = {}
        self.roster: Roster | None = None  # the run's actors (megatrain/roster.py), once spawned
        self.pids: dict[str, int] = {}
        self.marks: dict[str, dict] = {}  # each actor's start-up timeline (Role.mark)
        self.hosts = 1  # actors.num_hosts, resolved
        self.sentinels: dict[str, Pending] = {}  # per store owner, its serve() call
        self.serving = False  # the owners were asked for a store (serve_owner): they may hold shared memory
        self.local: dict[str, tuple[int, int]] = {}  # actors on this node: (pid, start ticks), waited for at the end
        self._owner_info: dict[str, Pending[ActorInfo]] = {}
        self._closed = False

    # ---- lifecycle --------------------------------------------------------------------------
    def spawn(self, name: str, cls: type, args: tuple, demand: Demand) -> None:
        self.actors[name] = self.runner.spawn(name, cls, args, demand)

    def drop(self, name: str) -> None:
        """End an actor the run turned out not to need."""
        self.runner.kill(self.actors.pop(name))

    def of(self, *kinds: Kind) -> list[str]:
        """The actors of these kinds, in spawning order (executor 0 first)."""
        return [n for n in self.actors if kind_of(n) in kinds]

    @property
    def owners(self) -> list[str]:
        """Every host's store owner, host 0's first."""
        return [on_host(OWNER, h) for h in range(self.hosts) if on_host(OWNER, h) in self.actors]

    def on(self, host: int, *kinds: Kind) -> list[str]:
        """The actors of these kinds on host `host`, in spawning order."""
        return [n for n in self.of(*kinds) if split_host(n)[1] == host]

    def serve_owner(self) -> None:
        self.serving = True
        for owner in self.owners:
            self.sentinels[owner] = self.call(owner, StoreOwner.serve)
            self._owner_info[owner] = self.call(owner, Role.info)  # waited for at the end even before attach

    def note_processes(self, infos: dict[str, ActorInfo]) -> None:
        """Record the attached actors' pids, and those on this node (not this process: the in-process runner's)
        to wait for at the end."""
        self.pids = {n: i.pid for n, i in infos.items()}
        for name, info in infos.items():
            self._note_local(name, info)

    def _note_local(self, name: str, info: ActorInfo) -> None:
        if info.host == socket.gethostname() and info.pid != os.getpid():
            ticks = start_ticks(info.pid)
            if ticks:  # 0: gone already (or unreadable); a pid reused since must not be waited for
                self.local[name] = (info.pid, ticks)

    def shutdown(self) -> None:
        """Idempotent: end every worker, then the owner (it unlinks everything of the run once they are
        gone), then release the runner. The caller defers SIGINT around it: it must finish."""
        if self._closed:
            return
        self._closed = True
        owners = {n: self.actors[n] for n in self.owners}
        for name, h in self.actors.items():
            if name not in owners:
                self.runner.kill(h)
        for name in owners:
            if self.serving and name not in self.pids and name in self._owner_info:
                try:  # a run that ends before the workers attach: the owner's process is still to be waited for
                    self._note_local(name, self.runner.result(self._owner_info[name], timeout=2))
                except Exception:
                    pass
        # each waits for its host's workers to be gone, then unlinks everything of its store; all at once
        ending = {n: self.runner.call(h, StoreOwner.shutdown) for n, h in owners.items()} if self.serving else {}
        for name, pending in ending.items():
            try:
                self.runner.result(pending, timeout=SHUTDOWN_S)
            except Exception as exc:  # the reaper unlinks if the owner is gone
                print(f"[megatrain] {name} did not shut down cleanly: {exc}", file=sys.stderr)
        for h in owners.values():  # without a store (an input refused after the spawn) it holds nothing to release
            self.runner.kill(h)
        self._wait_gone(GONE_S)
        self.runner.close()

    def _wait_gone(self, timeout: float) -> None:
        """Wait for the ended actors' processes on this node to exit (their mappings of the store with them)."""
        deadline = time.monotonic() + timeout
        while (alive := [n for n, (pid, ticks) in self.local.items() if live(pid, ticks)]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        if alive:
            names = ", ".join(f"{n} (pid {self.local[n][0]})" for n in alive)
            print(
                f"[megatrain] still running {timeout:.0f} s after they were ended: {names}; the memory they map is "
                "free only once they exit",
                file=sys.stderr,
            )

    # ---- calls ------------------------------------------------------------------------------
    def call(
        self, name: str, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]:
        """Start `method` (the actor class's own, e.g. AdamUpdater.step) on actor `name`; a method of another
        class or arguments that do not fit its signature raise TypeError here (launch/control/handles.py)."""
        return self.runner.call(self.actors[name], method, *args, **kwargs)

    def call_one(self, name: str, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """The call's result, waited for with the start-up timeout."""
        pending = self.call(name, method, *args, **kwargs)
        return self.gather({name: pending}, self.setup_timeout_s, f"{name}.{pending.method}")[name]

    def gather(
        self, calls: dict[str, Pending], timeout: float, what: str, optional: dict[str, Pending] | None = None
    ) -> dict[str, Any]:
        """Wait for every call in `calls`; a call in `optional` (the checkpoint being written) is watched
        for failure and its result taken if it ends meanwhile, but not waited for."""
        results: dict[str, Any] = {}
        pending = dict(calls)
        extra = {k: v for k, v in (optional or {}).items() if k not in pending}
        deadline = time.monotonic() + timeout
        while pending:
            watch = list(pending.values()) + list(extra.values()) + list(self.sentinels.values())
            done = self.runner.wait_any(watch, max(deadline - time.monotonic(), 0.0))
            if not done:
                self.abort(f"{what} timed out")
                raise MegatrainError(
                    f"{what} did not finish within {timeout:.0f}s; still waiting on: {', '.join(pending)}"
                )
            for p in done:
                owner = next((n for n, s in self.sentinels.items() if s is p), None)
                if owner is not None:
                    del self.sentinels[owner]
                    self._owner_died(owner, p, {**pending, **extra})
                key = next(k for k, v in {**pending, **extra}.items() if v is p)
                pending.pop(key, None)
                extra.pop(key, None)
                try:
                    results[key] = self.runner.result(p)
                except (ActorFailure, AbortError) as exc:
                    raise self._root_cause(exc, p.actor, {**pending, **extra}) from None
        return results

    # ---- failures ---------------------------------------------------------------------------
    def _owner_died(self, owner: str, serve: Pending, pending: dict[str, Pending]) -> None:
        """An owner's serve() call ended before shutdown: its process is gone, or the run was aborted."""
        try:
            self.runner.result(serve)
            exc: Exception = ActorFailure(owner, "stopped serving the store", self.pids.get(owner))
        except (ActorFailure, AbortError) as failure:
            exc = failure
        raise self._root_cause(exc, owner, pending)

    def _root_cause(self, first: Exception, actor: str, pending: dict[str, Pending]) -> MegatrainError:
        """Abort the run, let the others fail fast, and report the failure that started it all."""
        self.abort(f"{actor} failed")
        failures: list[Exception] = [first]
        # A stopped actor never answers: the verdict must not wait long, and after the stall monitor's verdict
        # (which names the stopped one itself) hardly at all: the others are only its victims.
        deadline = time.monotonic() + (0.5 if is_stall_verdict(first) else 5)
        for p in pending.values():
            try:
                self.runner.result(p, timeout=max(deadline - time.monotonic(), 0.1))
            except (ActorFailure, AbortError) as exc:
                failures.append(exc)
            except MegatrainError:
                pass
        real = [f for f in failures if isinstance(f, ActorFailure)]
        deaths = [f for f in real if f.died]
        root = (deaths or real or failures)[0]
        return root if isinstance(root, MegatrainError) else MegatrainError(str(root))

    def abort(self, reason: str) -> None:
        """Raise each host's shared abort flag through any actor of that host that still answers."""
        for host in range(self.hosts):
            for name in self.on(host, Kind.EXECUTOR, Kind.ADAM, Kind.PACKER, Kind.ACCUMULATOR, Kind.WRITER):
                if name not in self.pids:
                    continue
                try:
                    self.runner.result(self.runner.call(self.actors[name], Role.abort, reason), timeout=2)
                    break
                except Exception:
                    continue
