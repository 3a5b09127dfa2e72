"""The run's inputs: the checks of the model's config (transformers' import takes seconds), the data
(tokenized), the checkpoint a resume starts from (every checksum) and the model's structure. With Ray they are
read on a thread of the launcher while Ray starts and the actors spawn: the actors' own start (their imports) is
the longest part of the start-up, so they start first, and an input refused meanwhile ends them again before
the output directory or any shared memory is touched. A run that may resume, and the in-process runner, read
them first (launch/run/driver.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from megatrain.configbase import Where
from megatrain.data import Data, open_data
from megatrain.launch.config.tree import Config, validate_model
from megatrain.launch.run.resume import Start, choose_start
from megatrain.model import ModelSpec, build_spec, resolve_hf_config

T = TypeVar("T")

_READING: set[Background] = set()  # the calls still running on their threads
_LOCK = threading.Lock()


@dataclass
class Inputs:
    data: Data
    steps: int  # the run's steps (data.epochs may set them)
    begin: Start
    model: ModelSpec | None  # None when the run is already complete (nothing is built)


def read_inputs(cfg: Config, where: Where | None, out: Path) -> Inputs:
    validate_model(cfg, where)
    data = open_data(cfg.data, resolve_hf_config(cfg.model)[1], cfg.model.pretrained)
    steps = data.steps(cfg.train.steps)
    begin = choose_start(cfg, out, steps)
    return Inputs(data, steps, begin, None if begin.complete else build_spec(cfg.model, cfg.optim.no_decay_1d))


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
            _READING.add(self)
        threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True).start()

    def _run(self, fn: Callable[..., T], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # handed to the caller of result()
            self._error = exc
        finally:
            self._done.set()
            with _LOCK:
                _READING.discard(self)

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
        calls = list(_READING)
    return all(call.wait(deadline - time.monotonic(), stop) for call in calls)
