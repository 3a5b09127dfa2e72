"""One output directory, one live run: real launches on one directory, started together and staggered, and
a killed run that leaves no stale lock. The in-process runner keeps them quick: the lock is the launcher's."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tests.harness import Cli

FAST = ["launch.runner=inprocess", "train.final_eval=false", "train.eval_every=0", "train.log_every=1"]


def steps_written(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def refused_for(cli: Cli, live: Cli, starting_too: bool = False) -> None:
    """`cli` exited 2 with one line naming the live run (or, with `starting_too`, saying it was still
    starting: the two may race for the lock within the microseconds before the winner writes who it is)."""
    assert cli.finish(120) == 2, cli.text()
    err = "".join(cli.stderr)
    named = f"is in use by a live run (pid {live.proc.pid} on " in err and f"run {live.run_id}, since " in err
    assert named or (starting_too and "is in use by a live run (it is still starting" in err), err
    assert "Traceback" not in err and len([ln for ln in cli.stderr if ln.strip()]) == 1, err


def test_a_second_launch_on_a_live_runs_directory_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    live = Cli(tmp_path, *FAST, "train.save_every=20", steps=100000)  # stopped below
    live.wait_for(r"step 2/100000")
    held = json.loads((live.out / ".megatrain-live.json").read_text())
    assert held["pid"] == live.proc.pid and held["run_id"] == live.run_id
    refused_for(Cli(tmp_path, *FAST, steps=5), live)
    refused_for(Cli(tmp_path, *FAST, "train.overwrite=true", steps=5), live)  # not even with overwrite
    os.killpg(live.proc.pid, signal.SIGTERM)  # the step finishes, a checkpoint, exit 128 + 15
    assert live.finish(300) == 128 + signal.SIGTERM, live.text()
    written = steps_written(live.out)
    assert written == list(range(1, len(written) + 1)) and len(written) >= 2  # one run's rows, none twice
    live.assert_clean()
    assert not (live.out / ".megatrain-live.json").exists()  # a run that ends says so


def test_two_launches_started_together_on_one_directory_give_one_run(tmp_path: Path) -> None:
    a, b = Cli(tmp_path, *FAST, "train.save_every=2", steps=8), Cli(tmp_path, *FAST, "train.save_every=2", steps=8)
    codes = sorted([a.finish(300), b.finish(300)])
    assert codes == [0, 2], a.text() + b.text()
    winner, loser = (a, b) if a.proc.returncode == 0 else (b, a)
    refused_for(loser, winner, starting_too=True)
    assert steps_written(winner.out) == list(range(1, 9))
    assert sorted(p.name for p in (winner.out / "checkpoints").iterdir() if p.name.endswith(".tmp")) == []
    winner.assert_clean()


def test_a_killed_run_leaves_no_stale_lock(tmp_path: Path) -> None:
    killed = Cli(tmp_path, *FAST, steps=200)
    killed.wait_for(r"step 2/200")
    killed.snapshot()
    os.killpg(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait(30)
    killed.assert_clean()  # its reaper removes the store
    after = Cli(tmp_path, *FAST, "train.overwrite=true", steps=3)
    assert after.finish(300) == 0, after.text()
    assert steps_written(after.out) == [1, 2, 3]
