"""The worker threads of in-process actors and of an actor's own work: a call that never returns does not hold
the process's exit (as a killed Ray actor's process does not), and a dropped executor holds nothing of its
calls."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

from megatrain.daemons import DaemonExecutor
from megatrain.launch.control.runners import stuck_threads
from tests.harness import ROOT

STUCK = """
import threading
from megatrain.daemons import DaemonExecutor
pool = DaemonExecutor("stuck", 2)
pool.submit(threading.Event().wait)  # never set
pool.submit(threading.Event().wait)
print("leaving", flush=True)
"""


def test_a_call_that_never_returns_does_not_hold_the_exit() -> None:
    run = subprocess.run([sys.executable, "-c", STUCK], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == "leaving\n", run


def test_calls_run_in_order_and_carry_their_exceptions() -> None:
    pool = DaemonExecutor("order", 1)
    seen: list[int] = []
    futs = [pool.submit(seen.append, i) for i in range(5)]
    bad = pool.submit(int, "x")
    assert [f.result(10) for f in futs] == [None] * 5 and seen == [0, 1, 2, 3, 4]
    assert isinstance(bad.exception(10), ValueError)
    pool.shutdown()


def test_a_dropped_executor_ends_its_threads_and_holds_nothing_of_its_calls() -> None:
    class Memory:  # what an actor's call holds: pinned and GPU memory
        pass

    held = Memory()
    gone = weakref.ref(held)
    pool = DaemonExecutor("dropped", 2, initializer=lambda: None)
    assert pool.submit(id, held).result(10)
    threads = list(pool.threads)
    del held, pool
    gc.collect()
    for t in threads:
        t.join(10)
    assert gone() is None and not any(t.is_alive() for t in threads)


def test_shutdown_cancels_what_has_not_started_and_names_a_stuck_call() -> None:
    never, started = threading.Event(), threading.Event()
    pool = DaemonExecutor("actor", 1)

    def stuck() -> None:
        started.set()
        never.wait()

    running = pool.submit(stuck)
    queued = pool.submit(int, "1")
    assert started.wait(10)
    pool.shutdown()
    assert queued.cancelled() and not running.done()
    names = stuck_threads([pool], settle_s=0.2)
    assert len(names) == 1 and names[0].startswith("actor_0 (at threading.py:") and " in wait)" in names[0], names
    never.set()
    assert running.result(10) is None and stuck_threads([pool], settle_s=10) == []


def test_threads_start_with_the_first_call_and_never_twice() -> None:
    """As a ThreadPoolExecutor's: an executor never called holds no thread (an actor's compute thread on a
    device that never submits to it), and calls from several threads at once start each thread once."""
    before = threading.active_count()
    pool = DaemonExecutor("lazy", 2)
    assert threading.active_count() == before and stuck_threads([pool], settle_s=0) == []
    go = threading.Event()
    callers = [threading.Thread(target=lambda: (go.wait(), pool.submit(int, "2").result(10))) for _ in range(8)]
    for t in callers:
        t.start()
    go.set()
    for t in callers:
        t.join(10)
    assert all(t.ident is not None for t in pool.threads) and not any(t.is_alive() for t in callers)
    pool.shutdown()
