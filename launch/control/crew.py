"""The run's actors as the driver sees them: spawning and ending them, calling them, and waiting for the
calls with the run's failure handling (the failure that started it is the one reported, never its victims:
launch/control/failures.py)."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from megatrain.actors.base import Role
from megatrain.actors.store_owner import StoreOwner
from megatrain.errors import AbortError, ActorFailure, MegatrainError, ProtocolError, is_stall_verdict
from megatrain.ipc.messages import ActorInfo
from megatrain.ipc.procs import live, start_ticks, stopped
from megatrain.launch.control.failures import ABORTED, Heard, root_cause
from megatrain.launch.control.handles import Handle, Pending, Runner
from megatrain.launch.control.placement import Demand
from megatrain.roster import OWNER, Kind, Roster, kind_of, on_host, shown, split_host

P = ParamSpec("P")
R = TypeVar("R")
SHUTDOWN_S = 15.0
# How long the end of a run waits for its actors' processes on this node to exit once they were ended: the store's
# memory is the system's again only when the last process that maps it is gone, and the caller's next run (a bench's
# next row, a notebook's next Trainer) plans against what is free. Ray's kill reaches a frozen process in ~5 s.
GONE_S = 30.0
# After a failure, every host's word (its serve() call ends with its abort reason) and every actor's (alive, or
# found dead) come within a poll of the abort; the bound only ends a wait on a host that never answers.
HEAR_S = 30.0
# The calls still running once those are heard are its victims (every wait polls the abort flag): waited for
# this long from the failure, for the consequences error.log lists. After the stall monitor's verdict, which
# names the stopped actor itself (it never answers), nothing is waited for longer than STALL_HEAR_S.
VICTIMS_S, STALL_HEAR_S = 5.0, 0.5
SETTLE_S = 2.0  # at the end, how long the calls ended with the actors are waited for (their failures are known)


class Crew:
    """The actors by name, their pids and start-up marks once attached, and each store owner's serve() call,
    held open for the run's life: it ends (fails) when the owner dies or the run is aborted. Over several
    hosts every host has its own actors (named by megatrain/roster.py on_host) and its own store."""

    def __init__(self, runner: Runner, setup_timeout_s: float):
        self.runner, self.setup_timeout_s = runner, setup_timeout_s
        self.actors: dict[str, Handle[Any]] = {}
        self.roster: Roster | None = None  # the run's actors (megatrain/roster.py), once spawned
        self.pids: dict[str, int] = {}
        self.nodes: dict[str, str] = {}  # each attached actor's node (its host name), named in its failure
        self.inflight: set[Pending] = set()  # calls whose answer was not taken yet
        self.unsettled: list[Pending] = []  # calls left running by a failure: their answers are taken at the end
        self.marks: dict[str, dict] = {}  # each actor's start-up timeline (Role.mark)
        self.hosts = 1  # actors.num_hosts, resolved
        self.sentinels: dict[str, Pending] = {}  # per store owner, its serve() call
        self.serving = False  # the owners were asked for a store (serve_owner): they may hold shared memory
        self.local: dict[str, tuple[int, int]] = {}  # actors on this node: (pid, start ticks), waited for at the end
        self._owner_info: dict[str, Pending[ActorInfo]] = {}
        self._closed = False

    # ---- lifecycle --------------------------------------------------------------------------
    def span(self, hosts: int) -> None:
        """The run spans `hosts` hosts (actors.num_hosts, resolved once Ray counts its nodes): each has its own
        actors and store."""
        if self.actors:
            raise ProtocolError(f"the crew was told its hosts ({hosts}) after actors were spawned")
        self.hosts = hosts

    def staff(self, roster: Roster) -> None:
        """The run's actors (megatrain/roster.py), for the staging mode resolved before any worker is spawned."""
        self.roster = roster

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
        """Record the attached actors' pids (the runner names them in failures), nodes and start-up marks, and
        those on this node (not this process: the in-process runner's) to wait for at the end."""
        self.pids = {n: i.pid for n, i in infos.items()}
        self.runner.pids = self.pids
        self.nodes = {n: i.host for n, i in infos.items()}
        self.marks = {n: i.marks for n, i in infos.items()}
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
            except ActorFailure as exc:
                if not exc.died:  # a dead owner's store is its reaper's to unlink; its death is reported already
                    print(f"[megatrain] {self.shown(name)} did not shut down cleanly: {exc}", file=sys.stderr)
            except Exception as exc:
                print(f"[megatrain] {self.shown(name)} did not shut down cleanly: {exc}", file=sys.stderr)
        for h in owners.values():  # without a store (an input refused after the spawn) it holds nothing to release
            self.runner.kill(h)
        self._settle()
        self._wait_gone(GONE_S)
        self.runner.close()

    def _settle(self) -> None:
        """Take the answers of the calls a failure (or a signal) left running, now that their actors are ended: Ray
        prints a failed answer never taken, traceback and all, on the user's terminal (the failure is known)."""
        left, self.inflight = self.unsettled + list(self.inflight), set()
        if not self.runner.prints_untaken:
            left = []
        deadline = time.monotonic() + SETTLE_S
        for p in left:
            try:
                self.runner.result(p, timeout=max(deadline - time.monotonic(), 0.01))
            except Exception:
                pass
        self.unsettled.clear()

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
        pending = self.runner.call(self.actors[name], method, *args, **kwargs)
        self.inflight.add(pending)
        return pending

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
                self.inflight.discard(p)
                owner = next((n for n, s in self.sentinels.items() if s is p), None)
                if owner is not None:
                    del self.sentinels[owner]
                    self._owner_died(owner, p)
                key = next(k for k, v in {**pending, **extra}.items() if v is p)
                pending.pop(key, None)
                extra.pop(key, None)
                try:
                    results[key] = self.runner.result(p)
                except (ActorFailure, AbortError) as exc:
                    raise self._root_cause(exc, p.actor) from None
        return results

    # ---- failures ---------------------------------------------------------------------------
    def shown(self, name: str) -> str:
        """Actor `name` as messages name it: over several hosts with its host (roster.shown)."""
        return shown(name, self.hosts)

    def _owner_died(self, owner: str, serve: Pending) -> None:
        """An owner's serve() call ended before shutdown: its process is gone, or the run was aborted."""
        try:
            self.runner.result(serve)
            exc: ActorFailure | AbortError = ActorFailure(owner, "stopped serving the store", self.pids.get(owner))
        except (ActorFailure, AbortError) as failure:
            exc = failure
        raise self._root_cause(exc, owner)

    def _root_cause(self, first: ActorFailure | AbortError, actor: str) -> MegatrainError:
        """Abort the run on every host, hear every watcher, and report the failure that started it all
        (launch/control/failures.py), its consequences with it (error.log lists them)."""
        seen = self._heard(actor, first)
        self.abort(str(seen.error).removeprefix(ABORTED))  # what the driver knows so far, as each host's reason
        return root_cause([seen, *self._hear(first)])

    def _heard(self, name: str, error: ActorFailure | AbortError) -> Heard:
        """A failure of actor `name`'s call, under the name, pid and node messages give it."""
        if isinstance(error, ActorFailure):
            node = self.nodes.get(name, "") if self.hosts > 1 else ""
            error = error.named(self.shown(name), self.pids.get(name), node)
        return Heard(self.shown(name), error)

    def _hear(self, first: ActorFailure | AbortError) -> list[Heard]:
        """Every watcher's word, once the run is aborted: each host's abort reason (its owner's serve() call), each
        call still running (its victims, for the consequences), and whether each actor is alive (a death no call
        failed with, seen here even where the driver's abort reached the dead actor's host before its monitor
        did). A call not answered within the bounds is left to the end (_settle)."""
        stall = is_stall_verdict(first)
        dead = {first.actor} if isinstance(first, ActorFailure) and first.died else set()
        calls = {p: p.actor for p in self.inflight}
        words = {s: n for n, s in self.sentinels.items()}
        words |= {self.call(n, Role.info): n for n in self.actors if n not in dead}  # alive, or found dead
        self.sentinels.clear()
        start = time.monotonic()
        # A stopped process on this node (SIGSTOP, Ctrl-Z, a debugger) answers nothing until it is continued: its
        # calls are not waited for, where they would hold the report of the failure for HEAR_S.
        frozen = {n for n, (pid, ticks) in self.local.items() if stopped(pid, ticks)}
        waiting = {p: n for p, n in (calls | words).items() if n not in frozen}
        self.unsettled += [p for p, n in (calls | words).items() if n in frozen]
        heard: list[Heard] = []
        while waiting:
            limit = STALL_HEAR_S if stall else HEAR_S if any(p in words for p in waiting) else VICTIMS_S
            left = start + limit - time.monotonic()
            done = self.runner.wait_any(list(waiting), left) if left > 0 else []
            if not done:
                break
            for p in done:
                name = waiting.pop(p)
                self.inflight.discard(p)
                try:
                    self.runner.result(p)
                except (ActorFailure, AbortError) as exc:
                    heard.append(self._heard(name, exc))
                except MegatrainError:
                    pass
        self.unsettled += list(waiting)
        self.inflight.clear()
        return heard

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
