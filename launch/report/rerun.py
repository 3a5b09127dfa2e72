"""What running again does, said when a run ends early (a signal, a failure): the command that resumes it from
its checkpoint, or, with none, how to start over in its output directory.

The same command resumes only where it names the same output directory and train.resume is auto. The default
train.output_dir, runs/{run_id} with a random run id, is a new directory on every launch: there the command to
run is the same one with train.output_dir=DIR added, printed in full (and under `ray job submit`, in the job's
log, as the entrypoint to submit again).

The command starts the way that works from where the user stands: `megatrain-launch` where that name on PATH is
this environment's; else the script's full path, or `python -m megatrain.launch.cli` with this interpreter's full
path. A launch by a wrapper script that names its own config (run-default.sh) sets MEGATRAIN_RERUN to the script
as the user typed it: the command is the script then, with the user's arguments after it and not the config the
script adds."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from megatrain.formats import checkpoint as ckpt
from megatrain.launch.prepare.outdir import in_ray_job

PROGRAM = "megatrain-launch"
RERUN_ENV = "MEGATRAIN_RERUN"  # set by a wrapper script (run-default.sh) to itself, as the user typed it
RERUN_FROM_ENV = "MEGATRAIN_RERUN_FROM"  # and to the directory the user typed it in (the script changes it)
EXIT_FILE, RESUME_FILE = "exit.log", "RESUME"  # in the output directory of a run that ended early


def fixed_output(train: Any) -> bool:
    """The same command names the same output directory again (train: the config's TrainConfig)."""
    return "{run_id}" not in train.output_dir or bool(train.run_id)


def resume_command(argv: list[str], train: Any, out: Path, anywhere: bool = False) -> str:
    """The command line that continues the run in `out` from its newest checkpoint: `argv` (the config file, the
    overrides and options as given) with train.output_dir=OUT, and train.resume=auto where it was not, in place of
    their own overrides; shell-quoted. `anywhere`: with the launcher's full path, for a shell without this
    environment on its PATH."""
    drop = {"train.output_dir"} | ({"train.resume"} if train.resume != "auto" else set())
    kept = [a for a in argv if a.split("=", 1)[0].strip() not in drop]
    extra = [f"train.output_dir={out}"] + (["train.resume=auto"] if train.resume != "auto" else [])
    script = _script()
    if script and kept:
        return shlex.join([script, *kept[1:], *extra])  # the script adds its config (kept[0]) itself
    return shlex.join([*launcher(anywhere), *kept, *extra])


def _script() -> str | None:
    """The wrapper script that started this launch, as the user typed it (`./` before a bare name, which a
    shell would look for on PATH); None where none did."""
    script = os.environ.get(RERUN_ENV)
    if not script or in_ray_job():
        return None
    return script if "/" in script else f"./{script}"


def rerun_dir() -> Path:
    """The directory the resume command runs from: the user's, where a wrapper script changed it."""
    return Path(os.environ.get(RERUN_FROM_ENV) or os.getcwd()) if _script() else Path.cwd()


def launcher(anywhere: bool = False) -> list[str]:
    """The words that start megatrain-launch from any directory of the user's shell: the bare name where PATH
    finds this environment's script (or in a Ray job, whose entrypoint runs in the job's environment), unless
    `anywhere` asks for the full path (a shell whose PATH may be another)."""
    here = Path(sys.executable).parent / PROGRAM  # not resolved: a virtual environment's python is a link
    found = shutil.which(PROGRAM)
    on_path = found is not None and here.is_file() and Path(found).resolve() == here.resolve()
    if in_ray_job() or (on_path and not anywhere):
        return [PROGRAM]
    if here.is_file():
        return [str(here.absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "megatrain.launch.cli"]


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


def record_end(out: Path, line: str, argv: list[str], train: Any) -> None:
    """The launcher's last line into OUTPUT_DIR/exit.log and, where a checkpoint resumes the run, the command
    that does into OUTPUT_DIR/RESUME, runnable from any directory (`sh OUTPUT_DIR/RESUME`): the console may be
    gone with the same Ctrl-C (the reader of a `| tee`), the run's directory is not. Best-effort: a full disk
    must not cost the line on the console."""
    resume = out / RESUME_FILE
    try:
        (out / EXIT_FILE).write_text(line + "\n")
        latest = ckpt.latest(out / "checkpoints")
        if latest is None:
            resume.unlink(missing_ok=True)
            return
        command = f"cd {shlex.quote(str(rerun_dir()))} && {resume_command(argv, train, out, anywhere=True)}"
        resume.write_text(f"# {line}\n# resumes from {latest}; run it with: sh {shlex.quote(str(resume))}\n{command}\n")
    except OSError:
        pass
