"""Progress of a run on the console: a tqdm bar on a terminal, plain lines elsewhere.

Under `ray job submit`, CI or redirected output a bar's carriage returns become one line per refresh in
the log, so there a plain line says the same (step, loss, tokens/s, TFLOPS on a GPU, ETA): every
train.log_every steps, or with `auto` about every LINE_S seconds of wall time at a round step interval, so
that a log of a long run stays readable. While the bar is up, the run's other log lines go through it so
they do not tear it.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable

import megatrain
from megatrain import log

# The bar with the ETA of this module in its postfix, in place of tqdm's own (tqdm's rate counts the
# warm-up of the first step and follows every step's time, so it jumps like a last-step estimate).
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # tqdm puts ", " before a postfix
WINDOW = 20  # the recent steps the ETA's pace is taken from
LINE_S = 10.0  # train.log_every: auto: about this many seconds between plain lines


class Eta:
    """Time left: the pace of the last WINDOW steps (step end to step end) times the steps left. Recent steps
    only, so it follows a change of the machine's load within about WINDOW / 2 steps; the mean of the middle
    half of their times, so an occasional slow step (an evaluation, a checkpoint between steps) does not swing
    it, while steps alternating fast and slow give their average. The first step of the process is never in
    it: it pays for compilation, caches and the CUDA context."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic):
        self.total, self.clock = total, clock
        self.last: tuple[int, float] | None = None  # (step, when) of the latest step's end
        self.paces: deque[float] = deque(maxlen=WINDOW)  # seconds per step between consecutive step ends

    def step(self, done: int) -> None:
        now = self.clock()
        if self.last is not None and done > self.last[0]:
            self.paces.append((now - self.last[1]) / (done - self.last[0]))
        self.last = (done, now)

    def pace(self) -> float:
        """Seconds per step of late; nan while no step after the first has ended (nothing timed yet)."""
        if not self.paces:
            return float("nan")
        ranked = sorted(self.paces)
        cut = len(ranked) // 4
        return statistics.fmean(ranked[cut : len(ranked) - cut])

    def seconds(self, done: int) -> float:
        """nan while nothing is timed yet; 0 after the last step."""
        return 0.0 if done >= self.total else self.pace() * (self.total - done)


def auto_every(pace: float, target_s: float = LINE_S) -> int:
    """Steps between plain lines for about `target_s` seconds apart at `pace` seconds a step: the nearest of 1, 2, 5,
    10, 20, 50... (round step numbers in the log); 1 while nothing is timed (nan) or a step takes longer."""
    if not pace > 0 or pace >= target_s:
        return 1
    want = math.log10(target_s / pace)
    tens = math.floor(want)
    # the nearest in log scale of 1, 2, 5 and 10 times 10**tens
    return min((m * 10**tens for m in (1, 2, 5, 10)), key=lambda n: abs(math.log10(n) - want))


class Progress:
    def __init__(
        self, mode: str, first: int, total: int, log_every: int | str, clock: Callable[[], float] = time.monotonic
    ):
        """`log_every`: steps between plain lines, or 'auto' (auto_every of the recent pace)."""
        self.first, self.total, self.log_every = first, total, log_every
        self.eta = Eta(total, clock)
        self.next_line = first + 1  # the step of the next plain line: the first of this process is one
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
        elif done >= self.next_line or done == self.total:
            log(
                f"step {done}/{self.total} loss {row['loss']:.4f} lr {row['lr']:.2e} grad_norm {row['grad_norm']:.3f} "
                f"{speed} {row['step_time_s']:.3f} s/step {eta}"
            )
            every = auto_every(self.eta.pace()) if self.log_every == "auto" else int(self.log_every)
            self.next_line = (done - 1) // every * every + every + 1  # steps 1, 1 + every, 1 + 2 every...

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
