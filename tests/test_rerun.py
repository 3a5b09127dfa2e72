"""Running a run again after it ended early, through megatrain-launch's main() in this process (the in-process
runner): the default output directory is new on every launch, so a stop or a failure after a checkpoint prints
the command that resumes, and that command resumes exactly; a run stopped before its first checkpoint is
refused by name, and train.overwrite=true starts it over."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

import pytest

from megatrain.errors import ConfigError
from megatrain.formats import checkpoint as ckpt
from megatrain.launch.cli import main as cli
from megatrain.launch.config.train import TrainConfig
from megatrain.launch.prepare.outdir import prepare_output
from megatrain.launch.report.rerun import resume_command
from tests.harness import RERUN_ARGS as ARGS
from tests.harness import RERUN_STEPS as STEPS
from tests.harness import loss_rows as losses
from tests.harness import sigterm_after


@pytest.fixture(autouse=True)
def launcher_on_path(monkeypatch) -> None:
    """A shell in this environment: PATH finds its megatrain-launch, which the resume command names bare
    (tests/test_ended_early.py shows the other cases); no wrapper script started the launch."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("MEGATRAIN_RERUN", raising=False)


def last_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_stop_in_the_default_directory_prints_the_command_that_resumes_it(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main([*ARGS, f"train.output_dir={tmp_path / 'ref'}"]) == 0  # the uninterrupted run
    runs = tmp_path / "runs"
    sigterm_after(lambda: next(runs.glob("*/metrics.jsonl"), None), 3)
    capsys.readouterr()
    assert cli.main(ARGS) == 128 + signal.SIGTERM
    line = last_line(capsys)
    (out,) = runs.iterdir()  # runs/<run_id>, which the same command would not name again
    saved = ckpt.latest(out / "checkpoints")
    assert saved is not None and f"checkpoint {saved}; to resume from it, run: " in line, line
    command = shlex.split(line.split("to resume from it, run: ", 1)[1])
    assert command == ["megatrain-launch", *ARGS, f"train.output_dir={out}"], command
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the command holds the whole path
    assert cli.main(command[1:]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert losses(out) == losses(tmp_path / "ref")
    assert list(runs.iterdir()) == [out]


def test_a_failure_after_a_checkpoint_says_how_to_resume(tmp_path: Path, monkeypatch, capsys) -> None:
    import megatrain.actors.packer as packer

    real = packer.pack

    def pack(store, item, step):  # noqa: ANN001
        if step == 6:
            raise RuntimeError("boom in the packer")
        real(store, item, step)

    monkeypatch.setattr(packer, "pack", pack)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main([*ARGS, "train.save_every=2", "train.resume=none"]) == 1
    line = last_line(capsys)
    (out,) = (tmp_path / "runs").iterdir()
    assert "boom in the packer" in line and f"; checkpoint {ckpt.latest(out / 'checkpoints')}; " in line, line
    assert line.endswith(
        f"to resume from it, run: megatrain-launch {shlex.join(ARGS)} train.save_every=2 "
        f"train.output_dir={out} train.resume=auto"
    ), line


def test_a_run_stopped_before_its_first_checkpoint_is_refused_by_name_and_started_over(tmp_path: Path, capsys):
    out = tmp_path / "run"
    args = [*ARGS, f"train.output_dir={out}", "train.save_on_signal=false"]
    sigterm_after(lambda: out / "metrics.jsonl", 3)
    capsys.readouterr()
    assert cli.main(args) == 128 + signal.SIGTERM
    line = last_line(capsys)
    assert f"no checkpoint to resume from: train.overwrite=true starts over in {out}, or choose" in line, line
    stopped = losses(out)[-1][0]
    assert cli.main(args) == 2  # the same command: refused, saying why and what to do
    line = last_line(capsys)
    assert f"holds a run that stopped after step {stopped} of {STEPS}, before its first checkpoint" in line, line
    assert "train.overwrite=true starts over in it" in line and f"command line 'train.output_dir={out}'" in line
    assert cli.main([*args, "train.overwrite=true"]) == 0
    assert [s for s, _ in losses(out)] == list(range(1, STEPS + 1))


@pytest.mark.parametrize(
    "files, says",
    [
        ({"error.log": "boom"}, "holds a run that failed after step 2 (its error.log says why), before its first"),
        ({"config.yaml": "train: {steps: 5}\n"}, "holds a run that stopped after step 2 of 5, before its first"),
        ({"config.yaml": "train: {steps: 2}\n"}, "holds another run's metrics (2 steps"),  # it ended at its end
        ({"config.yaml": "train: {steps: 5}\ndata: {epochs: 1}\n"}, "holds another run's metrics (2 steps"),
    ],
)
def test_what_a_refused_directory_holds_is_told_from_what_its_run_left(tmp_path: Path, files: dict, says: str):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=r"train\.overwrite=true") as info:
        prepare_output(tmp_path, overwrite=False)
    assert says in str(info.value), info.value


def test_the_resume_command_keeps_the_arguments_and_names_the_directory(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "a b"
    argv = ["my model.yaml", "train.output_dir=elsewhere/{run_id}", 'model.hf={"hidden_size": 64}', "--address", "h:1"]
    want = ["megatrain-launch", "my model.yaml", 'model.hf={"hidden_size": 64}', "--address", "h:1"]
    command = resume_command(argv, TrainConfig(), out)
    assert shlex.split(command) == [*want, f"train.output_dir={out}"]
    # A run that started from another checkpoint (train.resume: PATH) continues from its own.
    command = resume_command([*argv, "train.resume=/old/run"], TrainConfig(resume="/old/run"), out)
    assert shlex.split(command) == [*want, f"train.output_dir={out}", "train.resume=auto"]
