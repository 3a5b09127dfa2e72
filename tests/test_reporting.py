"""Where a step goes besides metrics.jsonl: the console (a bar on a terminal, lines elsewhere) and TensorBoard."""

from __future__ import annotations

import json
import sys

import pytest

import megatrain
from megatrain.errors import ConfigError
from megatrain.launch.config.tree import load_config
from megatrain.launch.prepare.outdir import prepare_output
from megatrain.launch.report.progress import WINDOW, Eta, Progress, auto_every, clock
from megatrain.launch.run.driver import Trainer
from tests.harness import TINY


def row(step: int, seconds: float = 0.5) -> dict:
    return {
        "step": step,
        "step_time_s": seconds,
        "loss": 2.0 / step,
        "tokens_per_s": 1000.0,
        "lr": 1e-3,
        "grad_norm": 1.5,
    }


class FakeClock:
    """Wall time for the ETA, set by the test (no sleeping)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_every_log_every_steps_with_tflops_and_eta(capsys) -> None:
    wall = FakeClock()
    p = Progress("lines", 0, 10, log_every=4, clock=wall)
    for s in range(1, 11):
        wall.now += 30.0 if s == 1 else 0.5  # the first step's warm-up is not in the ETA
        p.step(row(s), tflops=4.0)
    p.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "step " in line]
    assert [line.split()[2] for line in lines] == ["1/10", "5/10", "9/10", "10/10"]
    assert "4.0 TFLOPS" in lines[0] and "0.500 s/step" in lines[0]
    assert lines[0].endswith("ETA ?")  # nothing timed after the first step yet
    assert lines[1].endswith("ETA 0:02") and lines[-1].endswith("ETA 0:00")  # 5 steps left at 0.5 s
    assert clock(3725.0) == "1:02:05" and clock(float("nan")) == "?"


def paced(eta: Eta, wall: FakeClock, seconds: list[float], first: int = 1) -> list[float]:
    """Steps `first`, first + 1... ending `seconds` apart: the ETA's seconds per step left after each."""
    left = []
    for i, took in enumerate(seconds):
        wall.now += took
        eta.step(first + i)
        left.append(eta.seconds(first + i) / (eta.total - first - i))
    return left


def test_eta_follows_a_change_of_pace_within_the_window() -> None:
    """50 steps at 1 s, then the machine gets busy: 3 s a step. Within WINDOW steps the ETA says 3 s a step
    (an average over the whole run would still say 1.6 then)."""
    wall = FakeClock()
    eta = Eta(1000, clock=wall)
    left = paced(eta, wall, [40.0] + [1.0] * 50 + [3.0] * 30)  # the first step's warm-up is never in it
    assert left[0] != left[0]  # nan: nothing timed yet after the first step
    assert all(x == 1.0 for x in left[1:51])
    assert all(x == 3.0 for x in left[51 + WINDOW :])
    assert min(left[51:]) >= 1.0 and left[51] < 1.5  # one slow step alone does not swing it


def test_eta_stays_put_through_an_occasional_slow_step_and_averages_alternating_ones() -> None:
    """A 60 s checkpoint or evaluation between 1 s steps, every 10th step: the pace stays 1 s. Steps that
    alternate 1 s and 3 s: their average, 2 s, not one of the two."""
    wall = FakeClock()
    eta = Eta(1000, clock=wall)
    left = paced(eta, wall, [40.0] + [60.0 if s % 10 == 0 else 1.0 for s in range(1, 100)])
    assert all(x == 1.0 for x in left[1:])
    wall = FakeClock()
    eta = Eta(1000, clock=wall)
    left = paced(eta, wall, [40.0] + [1.0 if s % 2 else 3.0 for s in range(1, 60)])
    assert all(1.0 <= x <= 3.0 for x in left[1:]) and all(1.9 <= x <= 2.1 for x in left[WINDOW:])
    assert eta.seconds(1000) == 0.0


def test_auto_lines_come_about_every_ten_seconds_at_round_steps(capsys) -> None:
    """train.log_every: auto: the first step, then a round interval that makes lines about LINE_S apart at the
    recent pace (0.09 s a step: every 100 steps; 4 s: every 2), following a change of pace; and the last."""
    assert [auto_every(p) for p in (float("nan"), 30.0, 10.0, 4.0, 1.0, 0.09, 0.06, 0.001)] == [
        1,
        1,
        1,
        2,
        10,
        100,
        200,
        10000,
    ]
    wall = FakeClock()
    p = Progress("lines", 0, 1000, log_every="auto", clock=wall)
    for s in range(1, 1001):
        wall.now += 5.0 if s == 1 else 0.09 if s <= 500 else 4.0
        p.step(row(s), tflops=None)
    p.close()
    steps = [int(line.split()[2].split("/")[0]) for line in capsys.readouterr().out.splitlines() if "step " in line]
    assert steps[:7] == [1, 2, 101, 201, 301, 401, 501]
    assert steps[-3:] == [997, 999, 1000] and len(steps) < 300  # 4 s a step: every 2 steps, not every one


def test_cpu_lines_show_tokens_per_second_without_tflops(capsys) -> None:
    p = Progress("lines", 0, 2, log_every=1)
    p.step(row(1), tflops=None)
    p.close()
    line = capsys.readouterr().out.strip()
    assert "1000 tok/s" in line and "TFLOPS" not in line


def test_a_run_continued_in_its_directory_says_so(tmp_path, capsys) -> None:
    """A resumed run's message speaks of the run going on, not of another run's files."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(row(s)) + "\n" for s in range(1, 8)))
    (out / "config.yaml").write_text("train: {}\n")
    prepare_output(out, overwrite=False, resume_step=5)
    said = capsys.readouterr().out
    assert (
        f"continuing the run in {out}: metrics.jsonl kept through step 5 (the steps after it are redone); "
        "config.yaml from before the stop removed (this run writes its own)" in said
    )
    assert "earlier run" not in said
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_auto_is_lines_when_stdout_is_no_terminal(capsys) -> None:
    p = Progress("auto", 0, 2, 1)  # pytest captures stdout: not a terminal
    assert p.bar is None
    p.close()


def test_bar_shows_step_loss_and_tflops_and_carries_the_log(capsys) -> None:
    p = Progress("bar", 2, 5, log_every=1)  # a resumed run: starts at step 2
    try:
        p.step(row(3), tflops=6.0)
        megatrain.log("evaluated")  # goes through the bar, not across it
        p.step(row(4), tflops=6.0)
        p.step(row(5), tflops=6.0)
    finally:
        p.close()
    out = capsys.readouterr().out
    assert "5/5" in out and "loss 0.4000" in out and "6.0 TFLOPS" in out and "[megatrain] evaluated" in out
    assert "ETA 0:00" in out and "<" not in out  # the ETA of this module, not tqdm's own estimate
    assert "step 3/5" not in out  # no plain lines while the bar is up
    megatrain.log("after")  # the bar's writer is gone with it
    assert capsys.readouterr().out == "[megatrain] after\n"


def test_tensorboard_gets_every_step(tmp_path, rid: str) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    cfg = load_config(
        None,
        [
            f"model.hf={hf}",
            "data.seq_len=32",
            "data.batch_size=2",
            "train.steps=3",
            "train.eval_every=2",
            f"train.run_id={rid}",
            "train.tensorboard=true",
            f"train.output_dir={tmp_path / 'out'}",
            "launch.runner=inprocess",
        ],
    )
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(tmp_path / "out" / "tb"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows])
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/tflops", "perf/step_time_s", "eval/loss"} <= set(
        acc.Tags()["scalars"]
    )
    assert [e.step for e in acc.Scalars("eval/loss")] == [2, 3]


def test_final_eval_false_leaves_out_only_the_closing_evaluation(tmp_path, rid: str, capsys) -> None:
    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    cfg = load_config(
        None,
        [
            f"model.hf={hf}",
            "data.seq_len=32",
            "data.batch_size=2",
            "train.steps=3",
            "train.eval_every=2",
            "train.final_eval=false",
            f"train.run_id={rid}",
            f"train.output_dir={tmp_path / 'out'}",
            "launch.runner=inprocess",
        ],
    )
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2]
    out = capsys.readouterr().out
    assert "eval after step 2" in out and "eval after step 3" not in out
    assert "greedy decoding after the last step" not in out


def test_tensorboard_missing_is_a_usage_error_before_anything_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    cfg = load_config(
        None, ["train.tensorboard=true", f"train.output_dir={tmp_path / 'out'}", "launch.runner=inprocess"]
    )
    with pytest.raises(ConfigError, match=r"train.tensorboard.*pip install 'megatrain\[tensorboard\]'"):
        Trainer(cfg).run()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.progress=fancy", "train.progress must be 'auto', 'bar' or"),
        ("train.log_every=0", "train.log_every must be a number of steps >= 1 or 'auto', not 0"),
        ("train.log_every=often", "train.log_every must be a number of steps >= 1 or 'auto', not 'often'"),
        ("train.profile.actor=packer", "train.profile.actor: 'packer' is not"),
        ("train.profile.step=-1", "train.profile.step must be >= 0"),
    ],
)
def test_bad_progress_and_profile_keys_are_named(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_the_old_profile_keys_are_read_as_train_profile(tmp_path, capsys) -> None:
    """A config saved before the rename (a run's config.yaml holds every key) still loads, as train.profile;
    the old and new name with different values is refused, naming both."""
    path = tmp_path / "old.yaml"
    path.write_text("train:\n  profile_step: 3\n  profile_actor: adam-updater\n")
    cfg = load_config(path, [])
    assert (cfg.train.profile.step, cfg.train.profile.actor) == (3, "adam-updater")
    assert "'train.profile_step' is now 'train.profile.step'" in capsys.readouterr().out
    assert load_config(None, ["train.profile_step=2", "train.profile.step=2"]).train.profile.step == 2
    with pytest.raises(ConfigError, match=r"train.profile_step.*renamed to 'train.profile.step', which is also"):
        load_config(None, ["train.profile_step=2", "train.profile.step=4"])


def test_a_launcher_execd_after_a_set_up_counts_from_the_exec() -> None:
    """run-default.sh sets up the environment (pip, seconds to minutes) in its own process, then execs Python,
    which keeps that process and its start: the start-up's first phase begins at the exec it records, not
    at the set-up's start. Without the record the process's start holds; a record older than it is stale."""
    import subprocess

    probe = (
        "import os, time; from megatrain.ipc.procs import started_at; from megatrain.launch.cli.main import "
        "_launched_at as at; s = started_at(os.getpid()); print(s, at(s), os.environ.get('MEGATRAIN_EXEC_AT', 0))"
    )
    script = f'sleep 1; {{}}exec "{sys.executable}" -c "{probe}"'
    for record in ('export MEGATRAIN_EXEC_AT="$(date +%s.%N)"; ', "", "export MEGATRAIN_EXEC_AT=1000; "):
        out = subprocess.run(["bash", "-c", script.format(record)], capture_output=True, text=True, check=True)
        start, launched, exec_at = map(float, out.stdout.split())
        if record.endswith('%N)"; '):
            assert launched == exec_at >= start + 0.9, out.stdout  # the set-up (the sleep) is not counted
        else:
            assert launched == start, out.stdout


def test_start_up_counts_from_the_launchers_start(tmp_path, rid: str) -> None:
    """The launcher passes its process's start: its own Python start and imports are the first phase, and the
    first step is done that much later after launch (here a start 30 s ago, as if the imports took that)."""
    import time

    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    over = [f"model.hf={hf}", "data.seq_len=32", "data.batch_size=2", "train.steps=2", "train.eval_every=0"]
    over += ["train.final_eval=false", f"train.run_id={rid}", f"train.output_dir={tmp_path / 'out'}"]
    began = time.time()
    summary = Trainer(load_config(None, [*over, "launch.runner=inprocess"]), launched=began - 30.0).run()
    took = time.time() - began
    phases = summary.startup_s
    first = next(iter(phases))
    assert first == "launcher started (Python, imports)" and 30.0 <= phases[first] < 30.0 + took, phases
    assert 30.0 + sum(list(phases.values())[1:]) <= summary.time_to_first_step_s < 30.0 + took
