"""Progress of a run on the console: a tqdm bar on a terminal, plain lines elsewhere.

Under `ray job submit`, CI or redirected output a bar's carriage returns become one line per refresh in
the log, so there a plain line every train.log_every steps says the same (step, loss, tokens/s,
TFLOPS, ETA). While the bar is up, the run's other log lines go through it so they do not tear it.
"""

from __future__ import annotations

import os
import sys
from collections import deque

import megatrain
from megatrain import log


class Progress:
    def __init__(self, mode: str, first: int, total: int, log_every: int):
        self.first, self.total, self.log_every = first, total, log_every
        self.recent: deque[float] = deque(maxlen=20)  # step times for the ETA
        self.bar = None
        if mode == "bar" or (mode == "auto" and sys.stdout.isatty()):
            from tqdm.auto import tqdm

            known = _width() > 0  # a terminal that reports no size (0x0) would get an empty bar
            self.bar = tqdm(total=total, initial=first, unit="step", file=sys.stdout, dynamic_ncols=known,
                            ncols=None if known else 100, nrows=None if known else 24)
            megatrain.set_log_writer(self.bar.write)

    def step(self, row: dict, tflops: float) -> None:
        """A step's metrics row is final (its Adam update applied)."""
        self.recent.append(row["step_time_s"])
        done = row["step"]
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {row['loss']:.4f} {row['tokens_per_s']:.0f} tok/s {tflops:.1f} TFLOPS",
                                     refresh=False)
            self.bar.update(done - self.bar.n)
        elif (done - 1) % self.log_every == 0 or done == self.total:
            log(f"step {done}/{self.total} loss {row['loss']:.4f} lr {row['lr']:.2e} grad_norm {row['grad_norm']:.3f} "
                f"{row['tokens_per_s']:.0f} tok/s {tflops:.1f} TFLOPS {row['step_time_s']:.3f} s/step "
                f"ETA {clock(self.eta_s(done))}")

    def eta_s(self, done: int) -> float:
        return (sum(self.recent) / len(self.recent)) * (self.total - done) if self.recent else float("nan")

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
