"""`ray job submit` end to end, against a head with the job server that this test starts (its own temp dir
and ports) and ends by pid: a run that succeeds with its logs and metrics, a run stopped by `ray job stop`
(STOPPED, a checkpoint, nothing left), and a cluster too small for the run (a message per role)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_leftovers

pytest.importorskip("ray.dashboard.modules.job", reason="needs megatrain[cluster] (ray[default])")
pytestmark = pytest.mark.slow
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}  # a throwaway cluster on localhost: no token to hand around
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def job_head():
    """A head with the dashboard's job server; its temp dir is short (Unix socket paths are limited)."""
    from megatrain.ipc.procs import descendants

    temp = tempfile.mkdtemp(prefix="mtjob", dir="/tmp")
    dash = free_port()
    # Every port of its own: another Ray instance of the session (tests/conftest.py) holds the defaults,
    # and a job agent that cannot bind its port leaves the job server with "No available agent".
    ports = [f"--{name}={free_port()}" for name in ("port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                     "metrics-export-port", "runtime-env-agent-port",
                                                     "ray-client-server-port")]
    proc = subprocess.Popen([*RAY, "start", "--head", "--block", *ports, f"--dashboard-port={dash}",
                             "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--num-cpus=8",
                             "--disable-usage-stats", f"--temp-dir={temp}"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **NO_AUTH})
    address = f"http://127.0.0.1:{dash}"
    try:
        # The job server answers before its agent on the head has registered ("No available agent to
        # submit job"): ready once a no-op job is taken.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and jobs(address, "submit", "--no-wait", "--", "true").returncode != 0:
            time.sleep(1)
        yield address
    finally:
        for pid in [proc.pid, *descendants([proc.pid])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        shutil.rmtree(temp, ignore_errors=True)


def jobs(address: str, verb: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`ray job VERB --address ADDRESS ARGS` (the address before a submitted entrypoint's `--`)."""
    return subprocess.run([*RAY, "job", verb, "--address", address, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **NO_AUTH})


def submit(address: str, sid: str, root: Path, *overrides: str, wait: bool = True) -> subprocess.CompletedProcess:
    env = {"env_vars": {"MEGATRAIN_OUTPUT_ROOT": str(root), "RAY_JOB_STOP_WAIT_TIME_S": "120", **NO_AUTH}}
    return jobs(address, "submit", f"--submission-id={sid}", f"--working-dir={ROOT / 'examples'}",
                f"--runtime-env-json={json.dumps(env)}", *([] if wait else ["--no-wait"]), "--",
                sys.executable, "-m", "megatrain.launch.cli", "default.yaml", *overrides)


def status(address: str, sid: str) -> str:
    from ray.job_submission import JobSubmissionClient

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        return str(JobSubmissionClient(address).get_job_status(sid).value)


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_submit_logs_stop_and_a_cluster_too_small(job_head: str, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    # A run that succeeds: a relative output_dir lands under MEGATRAIN_OUTPUT_ROOT, not in Ray's package cache.
    done = submit(job_head, "mtok", root, "train.steps=4", "train.run_id=jobok", "train.output_dir=out/{run_id}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert status(job_head, "mtok") == "SUCCEEDED"
    logs = jobs(job_head, "logs", "mtok").stdout
    assert f"output directory {root / 'out' / 'jobok'}" in logs and "done, 4 steps" in logs
    assert "ETA" in logs and "\r" not in logs  # plain lines under a job, not a bar
    rows = (root / "out" / "jobok" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 4]

    # `ray job stop`: the step in flight finishes, a checkpoint is written, nothing of the run is left.
    out = root / "out" / "jobstop"
    submit(job_head, "mtstop", root, "train.steps=100000", "train.run_id=jobstop", "train.output_dir=out/{run_id}",
           wait=False)
    wait_for(lambda: (out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2,
             120, "the stopped run's first steps")
    assert jobs(job_head, "stop", "mtstop").returncode == 0
    wait_for(lambda: status(job_head, "mtstop") == "STOPPED", 120, "STOPPED")
    assert (out / "checkpoints" / "latest").exists()
    assert "stopped by SIGTERM" in jobs(job_head, "logs", "mtstop").stdout
    wait_for(lambda: not run_leftovers("jobstop"), 30, "the stopped run's shared memory to go")

    # A cluster with fewer CPUs than the actors ask for: the job fails naming each role's need.
    small = submit(job_head, "mtsmall", root, "train.steps=2", "actors.num_packers=8", "ipc.weight_slabs=8",
                   "launch.placement_timeout_s=3",
                   "train.output_dir=out/{run_id}")
    assert small.returncode != 0 and status(job_head, "mtsmall") == "FAILED"
    logs = jobs(job_head, "logs", "mtsmall").stdout
    assert "they need 11 CPUs on one node (store-owner 0, gpu-executor 1, adam-updater 1, packer-0 1" in logs
    assert "actors.num_packers" in logs and "Traceback" not in logs
