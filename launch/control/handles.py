"""Typed actor calls: what the driver holds of an actor (Handle), of a call in flight (Pending), and the
interface both runners implement (Runner, launch/control/runners.py).

A call names the actor class's own method, not a string: `runner.call(h, AdamUpdater.step, request)`. A type
checker checks the arguments against the method's signature (ParamSpec); at run time `checked` refuses a
method of another class or arguments that do not bind to its signature with a TypeError in the driver,
before anything is sent, where a string name would fail in the actor's process, or not at all until the
call ran.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from megatrain.launch.control.placement import Demand

A = TypeVar("A")  # an actor class
P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


@dataclass(frozen=True)
class Handle(Generic[A]):
    """An actor: its role name, its class (what calls are checked against) and the runner's object (a Ray
    actor handle, or the instance itself in-process)."""

    name: str
    cls: type[A]
    obj: Any


@dataclass(eq=False)
class Pending(Generic[R_co]):
    """A call in flight; the runner's result(p) is the method's return value (type R)."""

    actor: str
    ref: Any  # ObjectRef or Future
    method: str = ""


def checked(h: Handle[Any], method: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> str:
    """The method's name, once `method` is known to be h's class's own (inherited counts) and the arguments
    bind to its signature; TypeError otherwise."""
    name = getattr(method, "__name__", "")
    if not name or name.startswith("_") or getattr(h.cls, name, None) is not method:
        raise TypeError(
            f"actor '{h.name}' ({h.cls.__name__}) has no method {getattr(method, '__qualname__', method)} to call"
        )
    try:
        inspect.signature(method).bind(None, *args, **kwargs)  # None: self
    except TypeError as exc:
        raise TypeError(
            f"{h.cls.__name__}.{name} called on actor '{h.name}' with arguments that do not fit its "
            f"signature {inspect.signature(method)}: {exc}"
        ) from None
    return name


def checked_init(cls: type, args: tuple) -> None:
    """The constructor's arguments bind to its signature (TypeError here, not in a new process)."""
    try:
        signature = inspect.signature(cls)
    except ValueError:  # a class without an introspectable signature (a builtin): its constructor checks
        return
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise TypeError(f"{cls.__name__}{signature} cannot take the arguments {args!r}: {exc}") from None


class Runner(Protocol):
    """One interface, two transports (launch/control/runners.py): Ray actors, each its own process, or threads of
    this process. `pids`: each actor's pid once attached (named in failures)."""

    pids: dict[str, int]
    prints_untaken: bool  # a call's failure whose answer is never taken is printed on the terminal (Ray does it)

    def connect(self, cpus_needed: float) -> None: ...

    def has_gpu(self) -> bool: ...

    def gpus(self) -> int: ...

    def place(self, bundle: dict[str, float], need: str = "", hosts: int = 1) -> None: ...

    def nodes(self) -> int: ...

    def host_address(self, host: int) -> str: ...

    def spawn(self, name: str, cls: type[A], args: tuple, demand: Demand) -> Handle[A]: ...

    def call(
        self, h: Handle[A], method: Callable[Concatenate[A, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]: ...

    def wait_any(self, pending: list[Pending[Any]], timeout: float) -> list[Pending[Any]]: ...

    def result(self, p: Pending[R], timeout: float | None = None) -> R: ...

    def kill(self, h: Handle[Any]) -> None: ...

    def close(self) -> None: ...
