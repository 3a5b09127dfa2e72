"""The disk a run needs in its output directory, for `megatrain-launch plan`: its checkpoints at their
peak (train.keep_last) and train.save_final's weights, against what is free there."""

from __future__ import annotations

import math
from pathlib import Path

from megatrain.errors import free_bytes, human_bytes
from megatrain.launch.config.train import TrainConfig


def disk_need(train: TrainConfig, checkpoint_bytes: int) -> tuple[int, str]:
    """The bytes a run's checkpoints take in its output directory at their peak, and how they are counted: a
    new one is complete before train.keep_last prunes the oldest, so keep_last + 1 of them at once."""
    every = f"{human_bytes(checkpoint_bytes)} each"
    if not train.saves_checkpoints:
        if not train.save_on_signal:
            return 0, "no checkpoints"
        return checkpoint_bytes, "one, written on a stop signal (train.save_on_signal)"
    if train.keep_last:
        n = train.keep_last + 1
        return n * checkpoint_bytes, f"train.keep_last {train.keep_last} + one being written, {every}"
    if train.save_every:
        n = math.ceil(train.steps / train.save_every) if train.steps else 1
        return n * checkpoint_bytes, (
            f"{n}, all kept (train.keep_last 0): one every {train.save_every} of "
            f"train.steps {train.steps} and one after the last, {every}"
        )
    return 2 * checkpoint_bytes, f"at least 2 (one per train.save_every_minutes, all kept: train.keep_last 0), {every}"


def disk_lines(train: TrainConfig, out: Path, checkpoint_bytes: int, final_bytes: int) -> list[str]:
    """The plan's disk section: what the checkpoints (and train.save_final's weights) need in the output
    directory, against what is free there; a warning when it is less."""
    need, how = disk_need(train, checkpoint_bytes)
    parts = [f"checkpoints {human_bytes(need)} ({how})"] if need else []
    if train.save_final:
        parts.append(f"final weights {human_bytes(final_bytes)} (train.save_final)")
        need += final_bytes
    if not need:
        return [f"disk: nothing written to {out} but metrics and logs (no checkpoints)"]
    free = free_bytes(out)
    lines = [f"disk: {human_bytes(need)} needed in {out}: {', '.join(parts)}; {human_bytes(free)} free there"]
    if free < need:
        lines.append(
            f"  WARNING: {human_bytes(need - free)} short: the run would stop when a checkpoint does not fit "
            "(free space, set train.keep_last lower, or choose another train.output_dir)"
        )
    return lines
