"""Graceful stop: the first SIGINT, SIGTERM or SIGHUP lets the current step finish, writes a checkpoint
(train.save_on_signal) and exits 128 + the signal's number; a second one stops at once (the same
cleanup as any failure: every process and segment of the run is released)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from megatrain import log

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # the second one: now
        self.signum = signum
        print(
            f"[megatrain] {signal.Signals(signum).name}: finishing the current step, then a checkpoint and "
            "exit (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handlers for the three signals, restored on exit (for callers that run main() in-process)."""
        old = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Cleanup must finish: a second Ctrl-C during it is reported, not obeyed."""
    try:
        old = signal.signal(signal.SIGINT, lambda *_: log("cleaning up, please wait"))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
