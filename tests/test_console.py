"""The console is best-effort, the run's files are not: a launcher whose output goes into a pipe whose reader
dies with it on Ctrl-C (`megatrain-launch CONFIG 2>&1 | tee run.log`) still writes its stop's checkpoint."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatrain.formats import checkpoint as ckpt
from megatrain.launch.report import console
from megatrain.launch.report.console import GuardedStream
from megatrain.launch.run.stopping import StopRequest, interrupted
from tests.harness import ROOT, Cli


def rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def wait_for_steps(cli: Cli, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout  # a bound for a hung start only: Ray starts slowly on a busy machine
    while len(rows(cli.out / "metrics.jsonl")) < n:
        assert time.monotonic() < deadline and cli.proc.poll() is None, f"no {n} steps:\\n{cli.text()}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tee") is None, reason="no tee on this machine")
@pytest.mark.parametrize("stderr_too", [True, False], ids=["2>&1 | tee", "| tee"])
def test_ctrl_c_with_the_pipe_reader_gone_still_checkpoints(tmp_path: Path, stderr_too: bool) -> None:
    """Ctrl-C reaches the whole foreground group: `tee` dies at once, and every console write of the launcher's
    stop meets a closed pipe. The launcher exits 130 with its stop's checkpoint complete, every step's metrics
    row, and no traceback anywhere; a SIGPIPE of its own does not end it either. Without 2>&1 its stderr (a
    file here) shows the stop's words and nothing of the broken pipe."""
    err = tmp_path / "stderr.txt"
    shell = (sys.executable, "-m", "tests.spawned", str(tmp_path / "run.log"), "2>&1" if stderr_too else str(err), "--")
    cli = Cli(tmp_path, "train.eval_every=0", "train.final_eval=false", steps=100000, wrap=shell)
    wait_for_steps(cli, 3)
    cli.snapshot()
    (launcher,) = [p for p in psutil.Process(cli.proc.pid).children() if "megatrain.launch.cli.main" in p.cmdline()]
    launcher.send_signal(signal.SIGPIPE)  # ignored: only a write's EPIPE says that the reader is gone
    os.killpg(cli.proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    assert cli.finish(timeout=180) == 128 + signal.SIGINT, cli.text()
    assert f"tee exit {-signal.SIGINT}" in "".join(cli.stdout)  # the pipe's reader died of it
    cli.assert_clean()
    done = rows(cli.out / "metrics.jsonl")
    assert [r["step"] for r in done] == list(range(1, len(done) + 1)) and len(done) >= 3
    assert [s for s, _ in ckpt.complete(cli.out / "checkpoints")] == [done[-1]["step"]]  # every step applied
    assert not (cli.out / "error.log").exists()
    # the stop's line and the command that resumes, which the dead pipe did not carry, are in the run's directory
    line = (cli.out / "exit.log").read_text()
    assert line.startswith(f"megatrain-launch: stopped by SIGINT after step {done[-1]['step']}; checkpoint "), line
    resume = (cli.out / "RESUME").read_text().splitlines()
    assert resume[0] == f"# {line.strip()}" and f"train.output_dir={cli.out}" in resume[-1], resume
    assert "\x1b" not in (tmp_path / "run.log").read_text()  # no colour codes into a pipe
    if not stderr_too:
        said = err.read_text()
        assert f"stopped by SIGINT after step {done[-1]['step']}; checkpoint" in said, said
        assert "Traceback" not in said and "Exception ignored" not in said and "BrokenPipe" not in said, said


@pytest.fixture
def broken_pipe():
    """A text stream into a pipe whose reader is gone (as `| tee` after Ctrl-C); closed after the test."""
    read, write = os.pipe()
    os.close(read)
    with contextlib.suppress(OSError), open(write, "w") as stream:  # closing flushes into the closed pipe
        yield stream


def target(stream) -> str:
    return os.readlink(f"/proc/self/fd/{stream.fileno()}")


@pytest.mark.parametrize("where", ["closed pipe", "full disk"])
def test_a_console_gone_drops_its_output_and_never_raises(where: str, broken_pipe) -> None:
    """EPIPE (the reader died) and ENOSPC (`> run.log` on a full disk, /dev/full here): the write that meets it
    and every later one are dropped, and the descriptor now writes to /dev/null, so the interpreter's flush at
    exit has nothing to complain about."""
    raw = broken_pipe if where == "closed pipe" else open("/dev/full", "w")  # noqa: SIM115
    try:
        out = GuardedStream(raw)
        assert out.write("[megatrain] step 1\n" * 1000) > 0  # more than a buffer: it reaches the descriptor
        out.flush()
        assert out.gone and target(raw) == "/dev/null"
        print("[megatrain] more", file=out, flush=True)
        raw.write("what the buffer kept\n")
        raw.flush()  # what the exit's flush does: no error now
    finally:
        raw.close()


def test_other_console_errors_raise_until_a_stop_is_requested() -> None:
    """A full non-blocking pipe (EAGAIN) is not a console that is gone: it raises, unless a stop was requested;
    from then on nothing of the console may end the run before its checkpoint."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        with open(write, "w") as raw:
            out = GuardedStream(raw)
            with pytest.raises(BlockingIOError):
                out.write("x" * 2**20)
                out.flush()
            assert not out.gone
            console.best_effort()
            try:
                out.write("x" * 2**20)
                out.flush()
            finally:
                console.best_effort(False)
            assert out.gone and target(raw) == "/dev/null"
    finally:
        os.close(read)


def test_escape_codes_reach_a_terminal_only() -> None:
    coloured = "\x1b[36m(StoreOwner pid=7)\x1b[0m [store-owner] paged in\n"
    plain = io.StringIO()
    GuardedStream(plain).write(coloured)
    assert plain.getvalue() == "(StoreOwner pid=7) [store-owner] paged in\n"
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            out = GuardedStream(tty)
            out.write(coloured)
            out.flush()
        assert os.read(master, 1000).decode().replace("\r\n", "\n") == coloured
    finally:
        os.close(master)
        os.close(slave)


def test_no_color_takes_the_colours_off_a_terminal_and_keeps_the_cursor_moves(monkeypatch) -> None:
    """NO_COLOR (no-color.org): a terminal still gets a bar's cursor moves, never a colour."""
    monkeypatch.setenv("NO_COLOR", "1")
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            out = GuardedStream(tty)
            out.write("\x1b[36m(StoreOwner pid=7)\x1b[0m paged in\x1b[1;32m!\x1b[m\x1b[2K\n")
            out.flush()
        assert os.read(master, 1000).decode().replace("\r\n", "\n") == "(StoreOwner pid=7) paged in!\x1b[2K\n"
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.slow
def test_the_fidelity_report_keeps_no_escape_codes_when_redirected(tmp_path: Path) -> None:
    """The fidelity tool through Ray, its output into files: the run's actor lines (Ray colours their prefixes)
    arrive without escape codes, as the report does."""
    argv = [str(ROOT / "examples/default.yaml"), "train.steps=2", "train.eval_every=0", "train.final_eval=false"]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        code = subprocess.run(
            [sys.executable, "-m", "megatrain.launch.cli.fidelity", *argv], stdout=out, stderr=err, cwd=ROOT
        ).returncode
    said = (tmp_path / "out.txt").read_text() + (tmp_path / "err.txt").read_text()
    assert code == 0 and "max per-step loss rel diff" in said, said
    assert "(StoreOwner pid=" in said and "\x1b" not in said, said


def test_the_first_signal_is_said_even_with_stderr_gone(broken_pipe, monkeypatch) -> None:
    """The stop's words meet a closed stderr inside the signal handler: the stop is still taken, not raised
    over; SIGPIPE is ignored while the handlers are installed."""
    monkeypatch.setattr(sys, "stderr", GuardedStream(broken_pipe))
    stop = StopRequest()
    with stop.installed():
        assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
        stop._handle(signal.SIGINT, None)
        assert stop.signum == signal.SIGINT and sys.stderr.gone
        print("[megatrain] checkpoint after step 3", file=sys.stderr, flush=True)  # dropped
    assert not console._stopping


def test_the_launcher_into_a_closed_pipe_exits_quietly() -> None:
    """`megatrain-launch CONFIG --print-config | head -0`: exit 0, and nothing on stderr (no error line about the
    pipe, no 'Exception ignored' from the exit's flush)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "megatrain.launch.cli.main", str(ROOT / "examples/default.yaml"), "--print-config"],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")


def published(root: Path, step: int) -> Path:
    """A complete checkpoint of `step` as far as finding one goes (a manifest, no planes)."""
    tmp = root / f"step-{step}.tmp-1"
    tmp.mkdir(parents=True)
    final = ckpt.step_dir(root, step)
    ckpt.publish(tmp, final, {"format": ckpt.FORMAT, "step": step, "files": {}})
    return final


def test_a_second_signal_says_which_steps_it_cost(tmp_path: Path) -> None:
    out = tmp_path / "run"
    lost = interrupted("SIGINT", out, 0, 57)
    assert lost.endswith(
        "interrupted by a second SIGINT after step 57: no checkpoint was written for the work since "
        "the last checkpoint (steps 1-57 are lost)"
    )
    assert interrupted("SIGTERM", out, 30, 57).endswith("(steps 31-57 are lost)")  # started from a checkpoint elsewhere
    published(out / "checkpoints", 20)
    published(out / "checkpoints", 40)
    assert interrupted("SIGINT", out, 0, 57).endswith("(steps 41-57 are lost)")
    assert interrupted("SIGINT", out, 0, 40).endswith("after step 40: every step trained is in the last checkpoint")
    assert interrupted("SIGHUP", None, 0, None).endswith("interrupted by a second SIGHUP before a step was trained")
