"""The fields of metrics.jsonl: one documented source for the README's table and the tests."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megatrain.errors import disk_full, is_disk_full
from megatrain.ipc.messages import StepReport

METRICS: dict[str, str] = {
    "step": "optimizer step, from 1",
    "epoch": "the data epoch the step's batch comes from, from 0",
    "loss": "mean token loss of the step's batch, before its update",
    "aux_loss": "mixture of experts: the step's load-balancing loss, as HF's `aux_loss` (before "
    "router_aux_loss_coef; part of the objective only with model.hf.output_router_logits)",
    "expert_load": "mixture of experts: per MoE layer, the tokens routed to each expert (top-k assignments)",
    "lr": "learning rate of the step's update",
    "tokens": "tokens of the batch that carry a label",
    "step_time_s": "wall time of the step as the driver sees it (with train.overlap_adam, Adam's tail overlaps "
    "the next step)",
    "tokens_per_s": "batch tokens (labelled or not) / step_time_s",
    "compute_s": "the executor's time in the step, streaming included (several executors: the longest)",
    "executor_compute_s": "several executors (actors.num_gpus): each one's compute_s, executor 0 first",
    "weight_wait_s": "time the executor waited for weights (loader behind compute)",
    "grad_wait_s": "time the executor waited for a free gradient slab (drainers behind)",
    "h2d_bytes": "weight bytes streamed to the device",
    "d2h_bytes": "gradient bytes streamed back",
    "forward_s": "executor phase split: forward",
    "head_s": "executor phase split: final norm, LM head and loss",
    "backward_s": "executor phase split: recompute and backward",
    "gpu_peak_bytes": "CUDA only: peak GPU memory allocated in the step",
    "gpu_units": "engine.gpu_optimizer: the units (from the embedding) whose update the executor made on its "
    "device (0 in a skipped step)",
    "gpu_update_s": "engine.gpu_optimizer: the executor's wait for Adam's global norm after its backward, and "
    "its update of those units",
    "grad_norm": "global gradient norm before clipping (inf or nan when the step was skipped)",
    "clip_scale": "factor the gradients were scaled by (1.0 when not clipped)",
    "skipped": "the step was skipped whole (a non-finite gradient, with clipping on)",
    "adam_s": "the Adam updater's time for the step (waits for the gradients included)",
    "adam_update_s": "the Adam updater's time updating (the sum over its pieces, no waits)",
    "speculated": "ipc.spare_slots: the units Adam updated speculatively into their spare slots while the backward "
    "ran (0 where the step did not speculate: too few unclipped steps before it, or none without clipping)",
    "committed": "ipc.spare_slots: of those, the units whose spare slot became their state (all of them where the "
    "step did not clip, else none)",
    "eval_loss": "evaluation steps only: mean token loss on the evaluation set",
    "eval_ppl": "evaluation steps only: exp(eval_loss)",
    "eval_tokens": "evaluation steps only: labelled tokens evaluated",
    "eval_s": "evaluation steps only: executor time of the evaluation",
    "eval_accuracy": "evaluation steps, generated arithmetic only: exact-match accuracy of greedy answers",
    "profile_trace": "profiled executor step: path of the Chrome trace (on the executor's node)",
    "loop_blocking_calls": "profiled executor step: host-blocking CUDA calls of the compute thread in the layer loop",
    "loop_blocking_names": "profiled executor step: their names",
    "loop_runtime_calls": "profiled executor step: CUDA runtime calls of the compute thread in the layer loop",
    "helper_thread_blocking_calls": "profiled executor step: host-blocking CUDA calls of the copy threads",
    "profile_error": "profiled executor step: why the check could not be made",
}


def metrics_table() -> str:
    lines = ["| field | meaning |", "|---|---|"] + [f"| `{k}` | {v} |" for k, v in METRICS.items()]
    return "\n".join(lines) + "\n"


def executor_row(row: dict, ex: StepReport) -> dict:
    """A step's metrics row from the driver's part (`t0` of its launch) and the executors' merged report."""
    dt = time.perf_counter() - row.pop("t0")
    part = ex.row()
    return {
        "step": row["step"],
        "epoch": row["epoch"],
        "loss": part.pop("loss"),
        "lr": row["lr"],
        "tokens": part.pop("tokens"),
        "step_time_s": dt,
        "tokens_per_s": row.pop("batch_tokens") / dt,
        **part,
    }


class MetricsFile:
    """metrics.jsonl, appended one whole row at a time. A write that fails part-way (a full disk) is cut back
    to the rows before it, so the file never ends in a partial line: a resumed run reads every row of it."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write_row(self, row: dict) -> None:
        line = (json.dumps(row) + "\n").encode()
        size = os.fstat(self.fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            os.ftruncate(self.fd, size)  # O_APPEND: whatever part of the row was written lies past `size`
            if is_disk_full(exc):
                raise disk_full(
                    self.path.parent,
                    f"step {row.get('step')}'s row of {self.path.name}",
                    len(line),
                    after="the rows before it are whole",
                ) from None
            raise

    def flush(self) -> None:
        """Nothing to flush: every row is written when it comes (sync() in launch/report/reporting.py fsyncs)."""

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
