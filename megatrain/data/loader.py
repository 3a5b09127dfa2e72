"""Batches prepared ahead of the step, in a background thread, so the step loop never builds one."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_END = object()


class Prefetcher:
    """Calls make(t) for t in [start, stop) in order, up to `depth` batches ahead of get()."""

    def __init__(self, make: Callable[[int], Any], start: int, stop: int, depth: int):
        self.make, self.next, self.stop = make, start, stop
        self.q: queue.Queue = queue.Queue(max(depth, 1))
        self.error: BaseException | None = None
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True) if depth else None
        if self.thread is not None:
            self.thread.start()

    def _run(self) -> None:
        try:
            for t in range(self.next, self.stop):
                if not self._put((t, self.make(t))):
                    return
        except BaseException as exc:  # re-raised in get()
            self.error = exc
        self._put((None, _END))

    def _put(self, item: tuple) -> bool:
        """Queue an item, waiting for room unless closed (then False)."""
        while not self.closed.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, t: int) -> Any:
        """Batch t; batches must be asked for in order."""
        if self.thread is None:
            return self.make(t)
        got, item = self.q.get()
        if item is _END:
            raise self.error if self.error else RuntimeError(f"batch {t} asked for past the end ({self.stop})")
        if got != t:  # the queue holds batches in order, from the start get() was made for
            raise RuntimeError(
                f"batch {t} asked for, but batch {got} is the next one prefetched: batches must be asked for in order"
            )
        return item

    def close(self) -> None:
        self.closed.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
