"""Which failure a failed run reports (launch/control/failures.py): the strongest the watchers saw (a death, a
stall, an actor's own error, the driver's abort), of equals the earliest; never the order in which their words
reached the driver. The others are listed as its consequences, in error.log."""

from __future__ import annotations

import itertools

from megatrain.errors import AbortError, ActorFailure, Origin
from megatrain.launch.control.failures import Heard, error_log, root_cause

DEATH_VERDICT = (
    "run aborted: actor 'adam-updater@host1' (pid 41, node n1) died: its process is gone (killed, or crashed in "
    "native code) while the run was in a step"
)


def two_host_kill() -> list[Heard]:
    """What the watchers of a two-host run say when host 1's Adam is SIGKILLed (times as they were seen): the other
    host's executor fails on the broken collective before the driver learns of the death itself."""
    return [
        Heard(
            "gpu-executor@host0",
            ActorFailure("gpu-executor@host0", "RuntimeError: Connection reset by peer", 10, at=1.0),
        ),
        Heard("gpu-executor@host1", AbortError(DEATH_VERDICT, Origin.DEATH, 1.2)),
        Heard("store-owner@host1", AbortError(DEATH_VERDICT, Origin.DEATH, 1.2)),
        Heard(
            "adam-updater@host1",
            ActorFailure("adam-updater@host1", "the process died (killed or crashed)", 41, True, at=1.5),
        ),
        Heard("store-owner@host0", AbortError("run aborted: gpu-executor@host0 failed", Origin.RELAY, 1.1)),
    ]


def test_the_death_is_named_whatever_the_order_its_watchers_were_heard_in() -> None:
    said = set()
    for heard in itertools.permutations(two_host_kill()):
        root = root_cause(list(heard))
        said.add(str(root))
        assert "adam-updater@host1" in str(root) and "died" in str(root), root
    assert len(said) == 1, said  # one verdict, word for word
    (only,) = said
    assert only == DEATH_VERDICT.removeprefix("run aborted: ")  # the death as it is, not as an abort


def test_the_consequences_are_every_other_failure_once_in_the_order_they_happened() -> None:
    root = root_cause(two_host_kill())
    assert root.consequences == [
        "actor 'gpu-executor@host0' (pid 10) failed: RuntimeError: Connection reset by peer",
        "run aborted: gpu-executor@host0 failed (ended: store-owner@host0)",
        f"{DEATH_VERDICT} (ended: gpu-executor@host1, store-owner@host1)",
    ]  # the driver's own word on the death is the root itself, not one of its consequences


def test_of_two_raises_the_earlier_is_named_and_the_actor_s_own_word_before_its_host_s() -> None:
    first = ActorFailure("packer-0@host1", "RuntimeError: boom", 7, traceback="the packer's stack", at=2.0)
    flag = AbortError("run aborted: packer-0@host1: RuntimeError: boom", Origin.RAISE, 2.001)
    later = ActorFailure("gpu-executor@host0", "RuntimeError: Connection reset by peer", 9, at=2.05)
    for heard in itertools.permutations([Heard("gpu-executor@host0", later), Heard("x", flag), Heard("p", first)]):
        root = root_cause(list(heard))
        assert root is first and root.traceback == "the packer's stack"


def test_a_stall_verdict_outranks_the_waits_it_ended_and_a_relay_names_nothing_better() -> None:
    stall = AbortError("run aborted: stalled: actor 'adam-updater' (pid 3) stopped running", Origin.STALL, 5.0)
    timeout = ActorFailure("gpu-executor", "WaitTimeout: waited 1s for the gradient", 4, at=6.0)
    assert root_cause([Heard("gpu-executor", timeout), Heard("store-owner", stall)]) is stall
    relay = AbortError("run aborted: gpu-executor failed", Origin.RELAY, 1.0)
    assert root_cause([Heard("store-owner", relay)]) is relay


def test_error_log_says_the_line_first_then_the_consequences_then_the_traceback() -> None:
    root = root_cause(two_host_kill())
    text = error_log("the line", root, "the driver's traceback")
    lines = text.splitlines()
    assert lines[0] == "the line" and lines[2] == "consequences, in the order they happened:"
    assert text.endswith("the driver's traceback") and "Connection reset by peer" in text
    raised = ActorFailure("packer-0", "RuntimeError: boom", traceback="its stack")
    assert error_log("line", raised, "here") == "line\n\ntraceback of actor 'packer-0':\nits stack"
