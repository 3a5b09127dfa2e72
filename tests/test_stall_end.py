"""Through Ray, one process per actor: after the stall monitor's verdict on a stopped actor, the launcher ends
within seconds, not after the driver has waited out the stopped actor's answer and Ray's own kill of it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import NO_AUTH, Cli

VERDICT = r"stalled: actor 'adam-updater' \(pid \d+\) stopped running"


def prestarted_workers(driver: int) -> list[str]:
    """The log files of the workers the driver's local Ray instance started for no job (Ray's idle ones, named
    for the nil job id); its head processes name its log directory."""
    for q in psutil.Process(driver).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            for arg in q.cmdline():
                if arg.startswith("--log_dir="):
                    return sorted(p.name for p in Path(arg.split("=", 1)[1]).glob("worker-*-ffffffff-*.out"))
    raise AssertionError(f"no Ray head process under the launcher (pid {driver})")


@pytest.mark.slow
def test_the_run_ends_within_seconds_of_the_stall_verdict(tmp_path: Path) -> None:
    cli = Cli(tmp_path, "ipc.stall_timeout_s=5", "train.log_every=1", steps=100000, env=NO_AUTH)
    pids = cli.actor_pids()
    cli.wait_for(r"step 3/100000")
    # The local instance started no idle worker per CPU beside the actors' own (launch/control/cluster.py).
    assert prestarted_workers(cli.proc.pid) == []
    cli.snapshot()
    os.kill(pids["adam-updater"], signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not any(re.search(VERDICT, line) for line in cli.stdout + cli.stderr):
        assert time.monotonic() < deadline and cli.proc.poll() is None, cli.text()
        time.sleep(0.01)
    seen = time.monotonic()
    assert cli.finish(timeout=60) == 1, cli.text()
    took = time.monotonic() - seen
    err = "".join(cli.stderr)
    assert re.search(f"megatrain-launch: error: run aborted: {VERDICT}", err), cli.text()
    # Was 14.5 s: 5 s waiting for the stopped actor's answer, 5 s for Ray's kill of it, the owner's and Ray's
    # shutdown; now the owner ends the stopped process itself after 1 s. Measured 6.6 s on 2 busy cores.
    assert took < 10, f"the launcher ended {took:.1f}s after the verdict"
    cli.assert_clean()
