"""Where a finished step goes: metrics.jsonl (one row per step, kept on disk before a checkpoint that
includes the step is published), the console (launch/report/progress.py), TensorBoard (train.tensorboard),
timeline.json (train.timeline_step) and the profiled step's verdict (train.profile)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from megatrain import log
from megatrain.ipc.protocol.messages import Applied
from megatrain.launch.config.train import TrainConfig
from megatrain.launch.report.describe import log_profile
from megatrain.launch.report.metrics import MetricsFile
from megatrain.launch.report.progress import Progress
from megatrain.launch.report.tensorboard import TensorBoard


class Reporter:
    def __init__(
        self,
        out: Path,
        cfg: TrainConfig,
        cuda: bool,
        flops_per_step: float,
        first: int,
        total: int,
        describe_eval: Callable[[int, dict], str],
    ):
        self.out, self.cuda, self.flops, self.describe_eval = out, cuda, flops_per_step, describe_eval
        # prepare_output emptied or trimmed it; closed by close(), which the driver calls on every path
        self.file = MetricsFile(out / "metrics.jsonl")  # whole rows only, even on a full disk
        self.progress = Progress(cfg.progress, first, total, cfg.log_every)
        self.tb = TensorBoard(out) if cfg.tensorboard else None

    def record(self, row: dict, adam: Applied) -> dict:
        """The step's row, completed with its Adam update's results, written everywhere; returned."""
        if "timeline" in row:  # kept out of metrics.jsonl: one file per picture
            timeline = {**row.pop("timeline"), "adam": adam.unit_spans, "step": row["step"]}
            (self.out / "timeline.json").write_text(json.dumps(timeline))
        if "profile_trace" in row:
            log_profile(row, self.cuda)
        row = {
            **row,
            "grad_norm": adam.grad_norm,
            "clip_scale": adam.clip_scale,
            "skipped": adam.skipped,
            "adam_s": adam.adam_s,
            "adam_update_s": sum(end - start for _, start, end in adam.unit_spans),
        }
        self.file.write_row(row)
        tflops = self.flops / row["step_time_s"] / 1e12
        # On a CPU the figure is a few hundredths at best: the console shows tokens/s alone there.
        self.progress.step(row, tflops if self.cuda else None)
        if self.tb is not None:
            self.tb.step(row, tflops)
        if any(k.startswith("eval_") for k in row):  # printed after its step's line, whatever the overlap
            log(self.describe_eval(row["step"], row))
        return row

    def sync(self) -> None:
        """metrics.jsonl on disk (a checkpoint is published only after its step's row is)."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.progress.close()
        if self.tb is not None:
            self.tb.close()
        self.file.close()
