"""Actor calls are checked in the driver, before anything is sent: a method the actor's class does not have,
a method of another class, or arguments that do not fit its signature raise there, and the actor never
runs a thing. Both runners implement the one Runner interface."""

from __future__ import annotations

import inspect
import threading

import pytest

from megatrain.actors.base import Role
from megatrain.launch.control.handles import Handle, Runner
from megatrain.launch.control.placement import Demand
from megatrain.launch.control.runners import InProcessRunner, LaunchConfig, RayRunner


class Probe(Role):
    """An actor that records every call that reaches it."""

    def __init__(self, label: str = "probe"):
        super().__init__(label)
        self.got: list[tuple] = []
        self.entered = threading.Event()

    def ping(self, value: int, twice: bool = False) -> int:
        self.got.append((value, twice))
        self.entered.set()
        return 2 * value if twice else value


class Other(Role):
    def ping(self, value: int) -> int:
        return value


@pytest.fixture
def runner() -> InProcessRunner:
    r = InProcessRunner(LaunchConfig(runner="inprocess"))
    yield r
    r.close()


def spawn(runner: InProcessRunner) -> Handle[Probe]:
    return runner.spawn("probe", Probe, (), Demand(0.0, 0.0))


def test_a_checked_call_runs_and_answers(runner: InProcessRunner) -> None:
    h = spawn(runner)
    assert runner.result(runner.call(h, Probe.ping, 3, twice=True), timeout=10) == 6
    assert runner.result(runner.call(h, Role.info), timeout=10).name == "probe"  # inherited methods are its own
    assert h.obj.got == [(3, True)]


def test_a_method_the_actor_does_not_have_fails_at_the_call_site(runner: InProcessRunner) -> None:
    h = spawn(runner)
    with pytest.raises(AttributeError):
        runner.call(h, Probe.pong, 1)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"actor 'probe' \(Probe\) has no method Other.ping"):
        runner.call(h, Other.ping, 1)  # another class's method of the same name
    with pytest.raises(TypeError, match="has no method"):
        runner.call(h, "ping", 1)  # type: ignore[arg-type]  # the old string form
    with pytest.raises(TypeError, match="has no method"):
        runner.call(h, Probe.__init__)  # not an actor method
    assert not h.obj.entered.is_set() and h.obj.got == []


def test_arguments_that_do_not_fit_fail_at_the_call_site(runner: InProcessRunner) -> None:
    h = spawn(runner)
    with pytest.raises(TypeError, match=r"Probe.ping called on actor 'probe' with arguments that do not fit"):
        runner.call(h, Probe.ping)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="do not fit"):
        runner.call(h, Probe.ping, 1, True, 3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="do not fit"):
        runner.call(h, Probe.ping, 1, thrice=True)  # type: ignore[call-arg]
    assert not h.obj.entered.is_set() and h.obj.got == []


def test_constructor_arguments_are_checked_before_the_actor_is_made(runner: InProcessRunner) -> None:
    with pytest.raises(TypeError, match="cannot take the arguments"):
        runner.spawn("probe", Probe, ("a", "b"), Demand(0.0, 0.0))
    assert "probe" not in runner.pools


def test_the_ray_runner_checks_before_anything_is_sent() -> None:
    """No Ray instance: a call that passed the checks would need one (the handle's object is a stand-in
    that fails the test if it is used)."""

    class Unsendable:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"something was sent: .{name}")

    ray_runner = RayRunner(LaunchConfig())
    h = Handle("probe", Probe, Unsendable())
    with pytest.raises(TypeError, match="has no method"):
        ray_runner.call(h, Other.ping, 1)
    with pytest.raises(TypeError, match="do not fit"):
        ray_runner.call(h, Probe.ping, 1, 2, 3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="cannot take the arguments"):
        ray_runner.spawn("probe", Probe, (1, 2), Demand(0.0, 0.0))


@pytest.mark.parametrize("cls", [InProcessRunner, RayRunner])
def test_both_runners_implement_the_runner_interface(cls: type) -> None:
    """Every member of the Runner protocol, with the same parameters (a checker sees the rest)."""
    members = [n for n, v in vars(Runner).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"spawn", "call", "wait_any", "result", "kill", "close", "connect", "place", "has_gpu"} <= set(members)
    for name in members:
        want = list(inspect.signature(getattr(Runner, name)).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == want, name
    assert "pids" in Runner.__annotations__
