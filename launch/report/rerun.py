"""What running again does, said when a run ends early (a signal, a failure): the command that resumes it from
its checkpoint, or, with none, how to start over in its output directory.

The same command resumes only where it names the same output directory and train.resume is auto. The default
train.output_dir, runs/{run_id} with a random run id, is a new directory on every launch: there the command to
run is the same one with train.output_dir=DIR added, printed in full (and under `ray job submit`, in the job's
log, as the entrypoint to submit again)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from megatrain import checkpoint as ckpt
from megatrain.launch.run.outdir import in_ray_job

PROGRAM = "megatrain-launch"


def fixed_output(train: Any) -> bool:
    """The same command names the same output directory again (train: the config's TrainConfig)."""
    return "{run_id}" not in train.output_dir or bool(train.run_id)


def resume_command(argv: list[str], train: Any, out: Path) -> str:
    """The command line that continues the run in `out` from its newest checkpoint: `argv` (the config file, the
    overrides and options as given) with train.output_dir=OUT, and train.resume=auto where it was not, in place of
    their own overrides; shell-quoted."""
    drop = {"train.output_dir"} | ({"train.resume"} if train.resume != "auto" else set())
    kept = [a for a in argv if a.split("=", 1)[0].strip() not in drop]
    extra = [f"train.output_dir={out}"] + (["train.resume=auto"] if train.resume != "auto" else [])
    return shlex.join([PROGRAM, *kept, *extra])


def how_to_continue(argv: list[str], train: Any, out: Path, checkpoint_only: bool = False) -> str:
    """What running again does for a run whose output directory `out` holds its files, on one line; '' where
    there is nothing to say: no checkpoint, and (`checkpoint_only`, or a new directory on every launch) no
    refusal ahead."""
    latest = ckpt.latest(out / "checkpoints")
    if latest is not None:
        if fixed_output(train) and train.resume == "auto":
            return f"checkpoint {latest}: the same command resumes from it (train.resume: auto)"
        how = "submit the job again with the entrypoint" if in_ray_job() else "run"
        return f"checkpoint {latest}; to resume from it, {how}: {resume_command(argv, train, out)}"
    if checkpoint_only:
        return ""
    if fixed_output(train) and (out / "metrics.jsonl").is_file():
        return (
            f"no checkpoint to resume from: train.overwrite=true starts over in {out}, or choose another "
            "train.output_dir"
        )
    return ""
