"""Which failure a run that failed reports: the one that started it, whichever watcher saw it first.

A run over several hosts has many watchers: each host's stall monitor (a worker's process gone, a stall), each
actor's guarded calls (its own exception), and the driver (a call that failed, an actor found dead). One failure
makes many: a killed actor's host aborts, its executor leaves the hosts' collective, the other host's executor
fails on the broken connection, and the driver aborts every host. Each host's abort flag keeps the first reason
raised on it, with what raised it and when (errors.Origin); the driver hears every watcher once the run is
aborted and names the strongest failure (a death, a stall, an actor's own error, its own abort), of equals the
earliest: never the order in which their answers happened to reach it. The rest are its consequences: listed
in error.log, never on the terminal.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatrain.errors import AbortError, ActorFailure, MegatrainError, Origin

ABORTED = "run aborted: "  # how every wait's AbortError begins (ipc/protocol/store.py)
VERDICT = re.compile(r"(?:run aborted: )?(?:stalled: )?actor '([^']+)'")  # whom a verdict or a failure is about


@dataclass(frozen=True)
class Heard:
    """What one watcher said: `who` (as messages name the actor) answered with `error`."""

    who: str
    error: ActorFailure | AbortError


def rank(heard: Heard) -> tuple[int, float, int]:
    """Strongest first, then earliest; of one failure seen by the driver and by a host alike, the driver's own
    (it has the actor's traceback)."""
    error = heard.error
    return int(error.origin), error.at or math.inf, 0 if isinstance(error, ActorFailure) else 1


def root_cause(heard: list[Heard]) -> MegatrainError:
    """The failure to report, with `consequences`: one line for each other failure heard (error.log lists them)."""
    if not heard:
        raise ValueError("a root cause needs at least one failure heard")
    first = min(heard, key=rank)
    error = first.error
    if isinstance(error, AbortError) and error.origin is Origin.DEATH:
        # the monitor's verdict, which names the dead actor itself: said as the death it is, not as an abort
        root: MegatrainError = MegatrainError(str(error).removeprefix(ABORTED))
    else:
        root = error
    root.consequences = consequences(first, heard)  # type: ignore[attr-defined]
    return root


def consequences(first: Heard, heard: list[Heard]) -> list[str]:
    """The other failures, in the order they happened: an actor's own failure as it is; the aborts, each reason
    once with the actors that ended on it."""
    lines: list[str] = []
    aborts: dict[str, list[str]] = {}
    for h in sorted(heard, key=lambda h: h.error.at or math.inf):
        if (h is first and isinstance(h.error, ActorFailure)) or _same_failure(h.error, first.error):
            continue  # the root itself (an abort stays: its line says which actors it ended)
        if isinstance(h.error, ActorFailure):
            line = str(h.error)
            if line not in lines and line != str(first.error):
                lines.append(line)
            continue
        reason = str(h.error)
        if reason not in aborts:
            aborts[reason] = []
            lines.append(reason)
        if h.who not in aborts[reason]:
            aborts[reason].append(h.who)
    return [f"{line} (ended: {', '.join(aborts[line])})" if aborts.get(line) else line for line in lines]


def _same_failure(one: ActorFailure | AbortError, other: ActorFailure | AbortError) -> bool:
    """The root cause seen by a second watcher: the driver's failed call on the actor whose death (or stall) a
    host's monitor named, or the other way round; not the aborts it caused (they say which actors it ended)."""
    if not isinstance(one, ActorFailure) or one.origin is not other.origin:
        return False
    about = VERDICT.match(str(other))
    return about is not None and about.group(1) == one.actor


def error_log(message: str, exc: BaseException, here: str) -> str:
    """error.log's text: the line the terminal shows, the failures it caused (the consequences), then the
    traceback of where it failed: the failing actor's own where it raised, else `here` (this process's)."""
    remote = getattr(exc, "traceback", "")
    detail = f"traceback of actor '{getattr(exc, 'actor', '')}':\n{remote}" if remote else here
    caused = getattr(exc, "consequences", [])
    listed = "consequences, in the order they happened:\n  " + "\n  ".join(caused) + "\n\n" if caused else ""
    return f"{message}\n\n{listed}{detail}"
