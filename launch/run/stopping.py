"""Graceful stop: the first SIGINT, SIGTERM or SIGHUP lets the current step finish, writes a checkpoint
(train.save_on_signal) and exits 128 + the signal's number; a second one stops at once (the same
cleanup as any failure: every process and segment of the run is released). From the first signal on the
console is best-effort (launch/report/console.py): a terminal or pipe gone with the same Ctrl-C or SIGHUP must not
cost the checkpoint. SIGPIPE is ignored: a closed pipe is a write's EPIPE, which the console drops."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatrain import checkpoint as ckpt
from megatrain.launch.report import console

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
