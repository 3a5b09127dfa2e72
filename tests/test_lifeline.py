"""The store owner's watch on its Ray node (actors/lifeline.py), on a real process standing in for the raylet:
its death is seen (a zombie its parent has not reaped counts as dead), once, and a stopped watch says nothing."""

from __future__ import annotations

import subprocess
import sys
import threading

from megatrain.actors.lifeline import RAYLET_ENV, Lifeline, raylet
from megatrain.ipc.procs import start_ticks

WAIT_S = 60  # only ends a wait for what never happens


def _node() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_the_raylets_death_is_seen_once_with_its_pid() -> None:
    node = _node()
    said: list[str] = []
    seen = threading.Event()
    try:
        line = Lifeline((node.pid, start_ticks(node.pid)), lambda why: (said.append(why), seen.set())).start()
        assert not seen.wait(0.5)  # alive: nothing to say
        node.kill()  # not reaped yet: a zombie, gone all the same
        assert seen.wait(WAIT_S)
        line.thread.join(WAIT_S)
        assert said == [f"its Ray node was lost (the node's raylet, pid {node.pid}, exited)"]
    finally:
        node.kill()
        node.wait()


def test_a_stopped_watch_outlives_its_node_quietly() -> None:
    node = _node()
    said: list[str] = []
    try:
        line = Lifeline((node.pid, start_ticks(node.pid)), said.append).start()
        line.stop()
        line.thread.join(WAIT_S)
        assert not line.thread.is_alive()
        node.kill()
        node.wait()
        assert said == []
    finally:
        node.kill()
        node.wait()


def test_only_a_ray_worker_has_a_raylet(monkeypatch) -> None:
    node = _node()
    try:
        monkeypatch.delenv(RAYLET_ENV, raising=False)
        assert raylet() is None  # the driver's process, the in-process runner's actors
        monkeypatch.setenv(RAYLET_ENV, str(node.pid))
        assert raylet() == (node.pid, start_ticks(node.pid))
        node.kill()
        node.wait()
        assert raylet() is None  # gone before the owner started: nothing to watch
        monkeypatch.setenv(RAYLET_ENV, "not-a-pid")
        assert raylet() is None
    finally:
        node.kill()
        node.wait()
