"""The executor's helper threads (the H2D loader, the D2H drain, the reducer): one per walk, its failure
resurfacing in the compute thread, and every wait of theirs timed and polling the abort flag."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from megatrain.errors import AbortError, WaitTimeout
from megatrain.ipc.protocol import Store

STOP = object()  # put by a thread that ends: whoever waits on its queue stops waiting


class Worker:
    """A per-step helper thread whose failure resurfaces in the compute thread."""

    def __init__(self, store: Store, name: str):
        self.store, self.name = store, name
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, target: Any) -> None:
        self.error = None

        def run() -> None:
            try:
                target()
            except BaseException as exc:  # surfaced by check()/join()
                self.error = exc

        self.thread = threading.Thread(target=run, name=self.name, daemon=True)
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def join(self) -> None:
        deadline = time.monotonic() + self.store.spec.ipc.wait_timeout_s
        if self.thread is not None:
            while self.thread.is_alive():
                self.thread.join(self.store.spec.ipc.poll_s)
                self.store.check_abort()
                self._check_deadline(deadline, f"the {self.name} thread to finish its walk")
        self.check()

    def acquire(self, sem: threading.Semaphore, what: str) -> None:
        """Semaphore acquire that honours the abort flag, the deadline and this worker's failure."""
        deadline = time.monotonic() + self.store.spec.ipc.wait_timeout_s
        while not sem.acquire(timeout=self.store.spec.ipc.poll_s):
            self.check()
            self.store.check_abort()
            self._check_deadline(deadline, what)

    def _check_deadline(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise WaitTimeout(f"waited {self.store.spec.ipc.wait_timeout_s:g}s for {what}")

    def take(self, q: queue.Queue, what: str) -> Any:
        """Queue get that honours the abort flag, the deadline and this worker's failure."""
        deadline = time.monotonic() + self.store.spec.ipc.wait_timeout_s
        while True:
            try:
                item = q.get(timeout=self.store.spec.ipc.poll_s)
            except queue.Empty:
                self.check()
                self.store.check_abort()
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"waited {self.store.spec.ipc.wait_timeout_s:g}s for {what}") from None
                continue
            if item is STOP:
                self.check()
                raise AbortError(f"{self.name} stopped")
            return item
