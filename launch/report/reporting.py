"""Where a finished step goes: metrics.jsonl (one row per step, kept on disk before a checkpoint that
includes the step is published), the console (launch/report/progress.py), TensorBoard (train.tensorboard),
timeline.json (train.timeline_step) and the profiled step's verdict (train.profile); and what a run
returns once it ends (RunSummary)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatrain import log
from megatrain.ipc.messages import Applied, FillReport, HostMemory
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
            "speculated": adam.speculated,
            "committed": adam.committed,
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


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What Trainer.run returns: how the run ended, the rows of the steps it trained, and what it ran with and
    on. Each host's store fill and memory, host 0's first. A run that was complete already (nothing was started)
    has its outcome only: the rest keeps its empty defaults."""

    run_id: str
    output_dir: Path
    steps: int  # the run's steps (data.epochs may set them)
    last_step: int  # the last step trained (a graceful stop's); a complete run's: its checkpoint's
    complete: bool = False  # the run had ended already: nothing was started
    stopped_by: str = ""  # the signal that stopped it gracefully; "" where it ran to its end
    checkpoint: Path | None = None  # the newest checkpoint written (a complete run's: the one it ended at)
    checkpoints: list[dict] = field(default_factory=list)  # each write's report, in order
    metrics: list[dict] = field(default_factory=list)  # the rows of metrics.jsonl this process wrote
    time_to_first_step_s: float | None = None  # launch to the first step's end
    startup_s: dict[str, float] = field(default_factory=dict)  # each start-up phase, in order
    fills: list[FillReport] = field(default_factory=list)  # each host's store: from what, how fast
    memory: list[HostMemory] = field(default_factory=list)  # each host's processes after the last step, as PSS
    cpu_plan: dict[str, dict] = field(default_factory=dict)  # host 0's actors' planned threads
    threads_observed: dict[str, dict] = field(default_factory=dict)  # what each actor runs with
    pids: dict[str, int] = field(default_factory=dict)  # every actor's
    num_params: int = 0
    active_params: int = 0  # those a token passes through (a mixture of experts: fewer than num_params)
    store_bytes: int = 0  # host 0's store
    executor_host_bytes: int = 0  # the pinned host RAM an executor takes for offloaded activation checkpoints
    staging: str = ""  # ipc.staging, resolved
    executors: int = 1  # each host's
    hosts: int = 1

    @property
    def clipped_fraction(self) -> float | None:
        """The share of the steps trained whose gradients were clipped (clip scale below 1); None: none trained."""
        return clipped_fraction(self.metrics)


def clipped_fraction(rows: list[dict]) -> float | None:
    """The share of `rows` (metrics rows) whose step clipped its gradients; None for no rows."""
    if not rows:
        return None
    return sum(r.get("clip_scale", 1.0) < 1.0 for r in rows) / len(rows)


def clipping_line(rows: list[dict], max_grad_norm: float) -> str:
    """The end of a run's line on clipping and on the units whose optimizer the GPU held."""
    share = clipped_fraction(rows)
    if share is None:
        return ""
    line = (
        f"clipping (optim.max_grad_norm {max_grad_norm:g}): {round(share * len(rows))} of {len(rows)} steps "
        f"clipped ({share:.0%})"
        if max_grad_norm > 0
        else "clipping off (optim.max_grad_norm 0)"
    )
    units = max(r.get("gpu_units") or 0 for r in rows)
    if units:
        line += f"; the optimizer of {units} units held and updated on the GPU (engine.gpu_optimizer)"
    speculated = sum(r.get("speculated") or 0 for r in rows)
    if speculated:
        kept = sum(r.get("committed") or 0 for r in rows)
        line += (
            f"; {speculated} unit updates speculated during the backward, {kept} of them kept "
            f"({kept / speculated:.0%}; ipc.spare_slots)"
        )
    return line
