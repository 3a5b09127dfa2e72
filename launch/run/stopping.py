"""Graceful stop: the first SIGINT, SIGTERM or SIGHUP lets the current step finish, writes a checkpoint
(train.save_on_signal) and exits 128 + the signal's number; a second one stops at once (the same
cleanup as any failure: every process and segment of the run is released), however soon after the first it
comes. Python runs a signal's handler once for any number of that signal that arrived before the main thread got
to it (a flag, not a count: the main thread waits in Ray's calls or for the GIL on a busy machine), so the
handler counts the deliveries from the wakeup pipe, where the interpreter writes a byte for each one. From the
first signal on the
console is best-effort (launch/report/console.py): a terminal or pipe gone with the same Ctrl-C or SIGHUP must not
cost the checkpoint. SIGPIPE is ignored: a closed pipe is a write's EPIPE, which the console drops.

The launcher's end waits for the calls it left running on threads of its own (Background: the run's inputs,
read beside Ray's start), up to a limit and not once a signal asks it out: a thread still running Python
while the interpreter exits races the exit handlers."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, TypeVar

from megatrain.formats import checkpoint as ckpt
from megatrain.launch.report import console

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
NUMBERS = frozenset(int(s) for s in SIGNALS)
T = TypeVar("T")

_RUNNING: set[Background] = set()  # the calls still running on their threads
_LOCK = threading.Lock()


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._wakeup: tuple[int, int] | None = None  # the pipe the interpreter writes each signal's number into
        self._bytes: Counter[int] = Counter()  # each signal's bytes read from it
        self._calls: Counter[int] = Counter()  # each signal's handler calls
        self._counted = 0  # the deliveries the handler has acted on
        self._first: int | None = None  # the first signal's number, as the pipe got it (handlers run in number order)
        # whether the first signal's stop writes a checkpoint (train.save_on_signal; the Trainer sets it)
        self.saves = True

    def _handle(self, signum: int, _frame: object) -> None:
        self._calls[signum] += 1
        received = self._received()
        if received <= self._counted:
            return  # a call for a signal already counted (two signals handled in one go)
        first = self.signum is None
        self._counted = received
        if first:
            self.signum = self._first or signum
        if received > 1:
            raise KeyboardInterrupt  # the second one: now
        console.best_effort()
        then = "then a checkpoint and exit" if self.saves else "then exit (train.save_on_signal is off: no checkpoint)"
        again = ", without a checkpoint" if self.saves else ""
        console.say(
            f"[megatrain] {self.name}: finishing the current step, {then} (send it again to stop at once{again})"
        )

    def _received(self) -> int:
        """The signals delivered so far. Neither count alone is sure: each handler call follows at least one
        delivery of its signal and each byte is one, but a call may run before its byte is written (the
        interpreter sets the flag first) or once for several; so for each signal, the larger."""
        if self._wakeup is not None:
            while True:
                try:
                    data = os.read(self._wakeup[0], 4096)
                except OSError:  # BlockingIOError: nothing more now
                    break
                if not data:
                    break
                ours = [b for b in data if b in NUMBERS]
                self._bytes.update(ours)
                self._first = self._first or (ours[0] if ours else None)
        return sum(max(self._bytes[s], self._calls[s]) for s in NUMBERS)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handlers for the three signals, and SIGPIPE ignored; restored on exit (for callers that run main()
        in-process)."""
        old = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        old[signal.SIGPIPE] = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        old_fd = self._open_wakeup()
        try:
            yield self
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self._close_wakeup(old_fd)
            console.best_effort(False)

    def _open_wakeup(self) -> int | None:
        """The wakeup pipe installed (the descriptor it replaces returned); None where none can be (a thread
        other than the main one): the handler's calls count alone then."""
        read, write = os.pipe()
        for fd in (read, write):
            os.set_blocking(fd, False)  # the interpreter's write must never block a signal's delivery
        try:
            old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            os.close(read)
            os.close(write)
            return None
        self._wakeup = (read, write)
        return old

    def _close_wakeup(self, old_fd: int | None) -> None:
        if self._wakeup is None:
            return
        signal.set_wakeup_fd(old_fd if old_fd is not None else -1)
        for fd in self._wakeup:
            os.close(fd)
        self._wakeup = None


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
