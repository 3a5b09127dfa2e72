"""Graceful stop: the first SIGINT, SIGTERM or SIGHUP lets the current step finish, writes a checkpoint
(train.save_on_signal) and exits 128 + the signal's number; a second one stops at once (the same
cleanup as any failure: every process and segment of the run is released). From the first signal on the
console is best-effort (launch/report/console.py): a terminal or pipe gone with the same Ctrl-C or SIGHUP must not
cost the checkpoint. SIGPIPE is ignored: a closed pipe is a write's EPIPE, which the console drops.

The launcher's end waits for the calls it left running on threads of its own (Background: the run's inputs,
read beside Ray's start), up to a limit and not once a signal asks it out: a thread still running Python
while the interpreter exits races the exit handlers."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, TypeVar

from megatrain import checkpoint as ckpt
from megatrain.launch.report import console

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
T = TypeVar("T")

_RUNNING: set[Background] = set()  # the calls still running on their threads
_LOCK = threading.Lock()


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # the second one: now
        self.signum = signum
        console.best_effort()
        console.say(
            f"[megatrain] {signal.Signals(signum).name}: finishing the current step, then a checkpoint and "
            "exit (send it again to stop at once, without a checkpoint)"
        )

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handlers for the three signals, and SIGPIPE ignored; restored on exit (for callers that run main()
        in-process)."""
        old = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        old[signal.SIGPIPE] = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        try:
            yield self
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            console.best_effort(False)


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Cleanup must finish: a second Ctrl-C during it is reported, not obeyed."""
    try:
        old = signal.signal(signal.SIGINT, lambda *_: console.say("[megatrain] cleaning up, please wait", err=False))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def interrupted(signame: str, out: Path | None, start: int, last: int | None) -> str:
    """The head of the line after a second signal (stop at once): what it cost. `out`: the run's output
    directory (None before it is known); `start`: the step the run started after; `last`: the last step recorded
    in this process (None: none). Where the run resumes from is said after it (launch/report/rerun.py)."""
    head = "megatrain-launch: interrupted" + (f" by a second {signame}" if signame else "")
    if last is None:
        return f"{head} before a step was trained"
    newest = ckpt.latest(out / "checkpoints") if out is not None else None
    saved = max(start, int((ckpt.manifest_of(newest) or {}).get("step", 0)) if newest else 0)
    if last <= saved:
        return f"{head} after step {last}: every step trained is in the last checkpoint"
    return (
        f"{head} after step {last}: no checkpoint was written for the work since the last checkpoint (steps "
        f"{saved + 1}-{last} are lost)"
    )


class Background(Generic[T]):
    """A call on a daemon thread: a Ctrl-C on the main thread is not held up at exit by a long read (a large
    dataset's tokenization), as a pool's thread would hold it."""

    def __init__(self, fn: Callable[..., T], *args: Any, name: str, here: bool = False) -> None:
        """`here`: call it on this thread, now (where nothing could run beside it)."""
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self.here = here
        if here:
            self._run(fn, args)
            return
        with _LOCK:
            _RUNNING.add(self)
        threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True).start()

    def _run(self, fn: Callable[..., T], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # handed to the caller of result()
            self._error = exc
        finally:
            self._done.set()
            with _LOCK:
                _RUNNING.discard(self)

    def failed(self) -> bool:
        """Done, with an exception (result() raises it)."""
        return self._done.is_set() and self._error is not None

    def wait(self, limit_s: float = float("inf"), stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait for the call to end, up to `limit_s` or until `stop()`; whether it ended. In short pieces: a
        signal on the main thread still interrupts it."""
        deadline = time.monotonic() + limit_s
        while not self._done.wait(0.1):
            if time.monotonic() >= deadline or stop():
                return False
        return True

    def result(self) -> T:
        """Wait, then the value or the call's exception."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def settle_reads(limit_s: float, stop: Callable[[], bool] = lambda: False) -> bool:
    """Wait, up to `limit_s` in all, for every call still running on its thread; whether all ended. A run that
    failed while its inputs were read beside it (a placement refused in seconds, while transformers still
    imports) calls this after its error is reported: a thread still running Python while the interpreter
    exits races the exit handlers (weakref's "dictionary changed size during iteration") or crashes the exit.
    The wait is in short pieces and ends as soon as `stop()` (a signal came: the user wants out)."""
    deadline = time.monotonic() + limit_s
    with _LOCK:
        calls = list(_RUNNING)
    return all(call.wait(deadline - time.monotonic(), stop) for call in calls)
