"""Worker threads that never hold the process's exit."""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

Call = tuple[cf.Future, Callable, tuple, dict]


class DaemonExecutor:
    """`workers` daemon threads taking calls in order: the threads of an in-process actor, and an actor's own
    work thread. Daemon threads, unlike a ThreadPoolExecutor's (joined when the interpreter exits), cannot hold
    the process's exit on a call that never returns, as a Ray actor's killed process cannot. As a
    ThreadPoolExecutor's, they end once the executor is dropped (or shut down) and hold nothing of it."""

    def __init__(self, name: str, workers: int = 1, initializer: Callable[[], object] | None = None):
        self.calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=_serve, args=(self.calls, initializer), name=f"{name}_{i}", daemon=True)
            for i in range(workers)
        ]
        self.started = False  # the threads start with the first call, as a ThreadPoolExecutor's
        self.starting = threading.Lock()  # calls may come from several threads at once
        weakref.finalize(self, _stop, self.calls, workers)

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        self.calls.put((fut, fn, args, kwargs))
        if not self.started:
            with self.starting:
                if not self.started:
                    for t in self.threads:
                        t.start()
                    self.started = True
        return fut

    def shutdown(self) -> None:
        """Cancel the calls not started and let every thread end after its current call."""
        while True:
            try:
                item = self.calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        _stop(self.calls, len(self.threads))


def _serve(calls: queue.SimpleQueue[Call | None], initializer: Callable[[], object] | None) -> None:
    if initializer is not None:
        initializer()
    while (item := calls.get()) is not None:
        fut, fn, args, kwargs = item
        del item  # the thread waits for the next call holding nothing of this one (an actor's memory)
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001  # the caller's future carries it, as Ray's would
                fut.set_exception(exc)
        del fut, fn, args, kwargs


def _stop(calls: queue.SimpleQueue[Call | None], workers: int) -> None:
    for _ in range(workers):
        calls.put(None)
