"""train.tensorboard: the run's scalars as TensorBoard event files in OUTPUT_DIR/tb."""

from __future__ import annotations

from pathlib import Path

from megatrain.errors import ConfigError

# metrics.jsonl field -> TensorBoard tag
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops": "perf/tflops",
    "step_time_s": "perf/step_time_s",
    "adam_s": "perf/adam_s",
    "gpu_peak_bytes": "memory/gpu_peak_bytes",
    "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy",
}


def summary_writer() -> type:
    """torch's SummaryWriter; a ConfigError naming the key when the tensorboard package is missing (checked
    before anything starts)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch raises this when the tensorboard package is missing
        raise ConfigError(
            "train.tensorboard: true needs the tensorboard package: pip install "
            "'megatrain[tensorboard]' (or pip install tensorboard), or set train.tensorboard: "
            "false"
        ) from None
    return SummaryWriter


class TensorBoard:
    def __init__(self, out: Path):
        writer_cls = summary_writer()
        self.dir = out / "tb"
        self.writer = writer_cls(str(self.dir))

    def step(self, row: dict, tflops: float) -> None:
        """One step's scalars: a row of metrics.jsonl, plus its TFLOPS."""
        values = {**row, "tflops": tflops}
        for key, tag in TAGS.items():
            if isinstance(values.get(key), (int, float)):
                self.writer.add_scalar(tag, values[key], row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
