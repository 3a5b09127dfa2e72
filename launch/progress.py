"""Progress of a run on the console: a tqdm bar on a terminal, plain lines elsewhere.

Under `ray job submit`, CI or redirected output a bar's carriage returns become one line per refresh in
the log, so there a plain line every train.log_every steps says the same (step, loss, tokens/s, TFLOPS on
a GPU, ETA). While the bar is up, the run's other log lines go through it so they do not tear it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import megatrain
from megatrain import log

# The bar with the ETA of this module in its postfix, in place of tqdm's own (tqdm's rate counts the
# warm-up of the first step and follows every step's time, so it jumps like a last-step estimate).
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # tqdm puts ", " before a postfix


class Eta:
    """Time left: the wall time since this process's first step ended, per step since, times the steps
    left. The first step is left out (it pays for compilation, caches and the CUDA context); evaluations
    and checkpoints between steps are in, as they will be in the steps left. An average over every step
    since the first does not jump from one line to the next as a single step's time does."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic):
        self.total, self.clock = total, clock
        self.since: tuple[int, float] | None = None  # (step, when) at the end of the first step

    def step(self, done: int) -> None:
        if self.since is None:
            self.since = (done, self.clock())

    def seconds(self, done: int) -> float:
        """nan while no step after the first has ended (nothing timed yet); 0 after the last."""
        if done >= self.total:
            return 0.0
        if self.since is None or done <= self.since[0]:
            return float("nan")
        first, when = self.since
        return (self.clock() - when) / (done - first) * (self.total - done)


class Progress:
    def __init__(self, mode: str, first: int, total: int, log_every: int, clock: Callable[[], float] = time.monotonic):
        self.first, self.total, self.log_every = first, total, log_every
        self.eta = Eta(total, clock)
        self.bar = None
        if mode == "bar" or (mode == "auto" and sys.stdout.isatty()):
            from tqdm.auto import tqdm

            known = _width() > 0  # a terminal that reports no size (0x0) would get an empty bar
            self.bar = tqdm(
                total=total,
                initial=first,
                unit="step",
                file=sys.stdout,
                dynamic_ncols=known,
                ncols=None if known else 100,
                nrows=None if known else 24,
                bar_format=BAR_FORMAT,
                postfix="ETA ?",
            )
            megatrain.set_log_writer(self.bar.write)

    def step(self, row: dict, tflops: float | None) -> None:
        """A step's metrics row is final (its Adam update applied). `tflops`: None where the figure means
        nothing (a CPU run: tokens/s says how fast it goes)."""
        done = row["step"]
        self.eta.step(done)
        speed = f"{row['tokens_per_s']:.0f} tok/s" + ("" if tflops is None else f" {tflops:.1f} TFLOPS")
        eta = f"ETA {clock(self.eta.seconds(done))}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {row['loss']:.4f} {speed} {eta}", refresh=False)
            self.bar.update(done - self.bar.n)
        elif (done - 1) % self.log_every == 0 or done == self.total:
            log(
                f"step {done}/{self.total} loss {row['loss']:.4f} lr {row['lr']:.2e} grad_norm {row['grad_norm']:.3f} "
                f"{speed} {row['step_time_s']:.3f} s/step {eta}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            megatrain.set_log_writer(None)


def _width() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError):
        return 0


def clock(seconds: float) -> str:
    """h:mm:ss (m:ss under an hour); '?' for nan (nothing timed yet)."""
    if seconds != seconds:
        return "?"
    m, s = divmod(int(round(max(seconds, 0))), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
