"""A run that ends early leaves its last line and the command that resumes it in its output directory (the
terminal or the `| tee` may have died with the Ctrl-C); that command works from where the user stands; a second
signal counts however soon after the first it comes; and what takes no time to check is refused before Ray
starts."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatrain.launch.cli import main as cli
from megatrain.launch.config.train import TrainConfig
from megatrain.launch.control.runners import RayRunner
from megatrain.launch.report import console, rerun
from megatrain.launch.run.stopping import StopRequest
from tests.data_fixtures import make_tokenizer, text_records, write_jsonl
from tests.harness import RERUN_ARGS as ARGS
from tests.harness import RERUN_STEPS as STEPS
from tests.harness import ROOT, sigterm_after
from tests.harness import loss_rows as losses

VENV_BIN = Path(sys.executable).parent
DEFAULT = str(ROOT / "examples/default.yaml")

# Two signals that reach the process while its main thread cannot run Python (in Ray's calls, or waiting for the
# GIL on a busy machine): the interpreter runs the handler once for both. The main thread blocks the signals
# and waits in a read that no signal interrupts; another thread sends them, 30 ms apart, and ends the read.
TWO_SIGNALS = """
import os, signal, sys, threading, time
from megatrain.launch.run.stopping import StopRequest

signals = [signal.Signals[name] for name in sys.argv[1:]]
stop = StopRequest()
with stop.installed():
    read, write = os.pipe()
    go = threading.Event()

    def send():
        go.wait()
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.03)
            os.kill(os.getpid(), sig)
        os.write(write, b"x")

    threading.Thread(target=send).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))  # this thread's only: the sender's take them
    go.set()
    try:
        os.read(read, 1)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(signals))
        # The handler runs here, once, whatever number came: at the interpreter's next check for signals,
        # which a busy machine may put some bytecodes later; so the thread waits for it (a bound: never a hang).
        deadline = time.monotonic() + 30
        while not stop.name and time.monotonic() < deadline:
            time.sleep(0.001)
        print("not interrupted", stop.name)
    except KeyboardInterrupt:
        print("interrupted", stop.name)
"""


@pytest.mark.parametrize(
    "signals, said",
    [
        (["SIGINT", "SIGINT"], {"interrupted SIGINT"}),
        # Which of two different signals is named first is the interpreter's order of its handlers when both
        # arrived before either ran (seen either way): what holds is that the second one stops at once.
        (["SIGTERM", "SIGINT"], {"interrupted SIGTERM", "interrupted SIGINT"}),
        (["SIGINT"], {"not interrupted SIGINT"}),  # one signal is never taken for two
    ],
)
def test_a_second_signal_counts_however_soon_it_comes(signals: list[str], said: set[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", TWO_SIGNALS, *signals], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in said, done.stdout + done.stderr


@pytest.fixture
def broken_console(monkeypatch):
    """stdout and stderr into pipes whose reader is gone, as after a Ctrl-C that ended `| tee`."""
    streams = []
    for name in ("stdout", "stderr"):
        read, write = os.pipe()
        os.close(read)
        stream = open(write, "w")  # noqa: SIM115 - closed below
        streams.append(stream)
        monkeypatch.setattr(sys, name, stream)
    yield
    for stream in streams:
        try:
            stream.close()
        except OSError:
            pass


def test_a_stop_with_the_console_gone_leaves_its_line_and_resume_command_in_the_run(
    tmp_path: Path, monkeypatch, broken_console
) -> None:
    """The stop's line is in OUTPUT_DIR/exit.log, and `sh OUTPUT_DIR/RESUME`, run from another directory with
    another PATH, resumes the run to its end."""
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    sigterm_after(lambda: next(runs.glob("*/metrics.jsonl"), None), 3)
    assert cli.main(ARGS) == 128 + signal.SIGTERM
    (out,) = runs.iterdir()
    line = (out / "exit.log").read_text()
    stopped = losses(out)[-1][0]
    assert line.startswith(f"megatrain-launch: stopped by SIGTERM after step {stopped}; checkpoint "), line
    assert not (out / "error.log").exists()
    resume = (out / "RESUME").read_text()
    assert resume.startswith(f"# {line}"), resume
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # a shell where this environment is not activated
    done = subprocess.run(["sh", str(out / "RESUME")], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout, done.stdout[-3000:]
    assert [s for s, _ in losses(out)] == list(range(1, STEPS + 1))
    assert not (out / "RESUME").exists() and not (out / "exit.log").exists()  # the run they were about is done


def test_a_stop_without_a_checkpoint_leaves_its_line_and_no_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    sigterm_after(lambda: out / "metrics.jsonl", 3)
    assert cli.main([*ARGS, f"train.output_dir={out}", "train.save_on_signal=false"]) == 128 + signal.SIGTERM
    line = (out / "exit.log").read_text()
    assert line.startswith(f"megatrain-launch: stopped by SIGTERM after step {losses(out)[-1][0]}; no checkpoint"), line
    assert not (out / "RESUME").exists()  # nothing to resume from


def test_the_resume_command_starts_the_way_that_works_from_the_users_shell(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "runs" / "abc"
    argv = [DEFAULT, "train.steps=200"]
    monkeypatch.delenv(rerun.RERUN_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}/usr/bin:/bin")
    assert shlex.split(rerun.resume_command(argv, TrainConfig(), out))[0] == "megatrain-launch"
    # the full path where PATH finds no megatrain-launch, or another environment's
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    first = shlex.split(rerun.resume_command(argv, TrainConfig(), out))[0]
    assert first == str(VENV_BIN / "megatrain-launch") and Path(first).is_file()
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}/usr/bin:/bin")
    full = shlex.split(rerun.resume_command(argv, TrainConfig(), out, anywhere=True))[0]
    assert full == str(VENV_BIN / "megatrain-launch")
    # started by run-default.sh, which adds examples/default.yaml itself: the script with the user's overrides
    for typed, said in (("./run-default.sh", "./run-default.sh"), ("run-default.sh", "./run-default.sh")):
        monkeypatch.setenv(rerun.RERUN_ENV, typed)
        command = shlex.split(rerun.resume_command(argv, TrainConfig(), out))
        assert command == [said, "train.steps=200", f"train.output_dir={out}"], command


def test_run_default_names_itself_for_the_resume_command() -> None:
    """run-default.sh exports the script as typed and the directory it was typed in, before it changes
    directory: what the resume command is made of (launch/report/rerun.py)."""
    script = (ROOT / "run-default.sh").read_text()
    exports = [f'export {rerun.RERUN_ENV}="$0"', f'export {rerun.RERUN_FROM_ENV}="$PWD"']
    assert all(e in script for e in exports), script
    assert max(script.index(e) for e in exports) < script.index('cd "$(dirname "$0")"')


@pytest.fixture
def ray_never_starts(monkeypatch):
    """A refusal of these inputs must come before Ray is asked to start: asking for it fails the test."""

    def connect(self, cpus_needed: float) -> None:
        raise AssertionError("Ray was started for a run whose input is refused")

    monkeypatch.setattr(RayRunner, "connect", connect)


def _refused(capsys, *argv: str) -> str:
    code = cli.main([DEFAULT, "launch.runner=ray", *argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Ray was started" not in err, err
    return err


def test_inputs_that_take_no_time_to_check_are_refused_before_ray_starts(
    capsys, tmp_path: Path, ray_never_starts
) -> None:
    out = tmp_path / "out"
    err = _refused(capsys, "data.kind=text", f"data.path={tmp_path / 'none.jsonl'}", f"train.output_dir={out}")
    assert f"data.path: file '{tmp_path / 'none.jsonl'}' does not exist" in err, err
    tok = make_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "d.jsonl", text_records(50))
    text = ["data.kind=text", f"data.path={data}", f"data.tokenizer={tok}", f"train.output_dir={out}"]
    err = _refused(capsys, *text, "model.hf.vocab_size=280")
    assert "data.tokenizer: the tokenizer in" in err and "more than the model's vocab_size 280" in err, err
    held = tmp_path / "held"
    held.mkdir()
    (held / "metrics.jsonl").write_text('{"step": 1}\n')
    err = _refused(capsys, f"train.output_dir={held}")
    assert "train.output_dir" in err and "train.overwrite=true" in err, err
    assert sorted(p.name for p in held.iterdir()) == ["metrics.jsonl"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_budget_without_a_gpu_is_refused_by_the_run_and_the_plan_alike(
    capsys, tmp_path: Path, ray_never_starts
) -> None:
    """engine.gpu_memory_gib is a GPU's: where engine.device auto finds none, neither trains the CPU with it
    ignored nor plans a GPU the run will not have."""
    err = _refused(capsys, "engine.gpu_memory_gib=8", f"train.output_dir={tmp_path / 'out'}")
    assert "command line 'engine.gpu_memory_gib=8': engine.gpu_memory_gib: 8.0 GiB is the budget of a GPU" in err
    assert cli.main(["plan", DEFAULT, "engine.gpu_memory_gib=8"]) == 2
    said = capsys.readouterr()
    assert "engine.gpu_memory_gib: 8.0 GiB is the budget of a GPU, but this machine has none" in said.err, said
    assert cli.main(["plan", DEFAULT, "engine.gpu_memory_gib=8", "--gpu-gib", "8"]) == 0  # another machine's GPU


@pytest.mark.parametrize("saves, said", [(True, "then a checkpoint and exit"), (False, "save_on_signal is off")])
def test_the_first_signals_line_promises_a_checkpoint_only_where_one_is_written(
    saves: bool, said: str, monkeypatch
) -> None:
    lines: list[str] = []  # the line as the handler says it (the console's own writing is tested in test_console)
    monkeypatch.setattr(console, "say", lambda text, err=True: lines.append(text))
    request = StopRequest()
    request.saves = saves
    with request.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while request.signum is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert request.signum == signal.SIGTERM
    assert len(lines) == 1 and said in lines[0], lines
