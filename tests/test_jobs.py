"""Ray as users run it, with Ray's default token authentication (Ray 2.60: a local ray.init makes and uses a
token in ~/.ray/auth_token, `ray start` turns token authentication on wherever it finds one). Each test has a
HOME of its own (its ~/.ray/auth_token), so the user's token is neither read nor written.

`ray job submit` end to end, against a head with the job server that this module starts the way the README
says (its own temp dir and ports) and ends by pid: a run that succeeds with its logs and metrics; a run
stopped by `ray job stop` (STOPPED, a checkpoint, nothing left), resumed by the entrypoint its log gives,
stopped again and resumed by that same entrypoint, ending bit for bit where the uninterrupted run ended; and a
cluster too small for the run (a message per role). Joining the head with --address from a shell that exported
nothing; a refused token in one line; a local run with no token warning."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import ROOT, guard_tree, run_leftovers, stop_guard

pytest.importorskip("ray.dashboard.modules.job", reason="needs megatrain[cluster] (ray[default])")
pytestmark = pytest.mark.slow
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
LAUNCH = [sys.executable, "-m", "megatrain.launch.cli.main"]
SMALL = ["model.hf.hidden_size=32", "model.hf.intermediate_size=64", "data.seq_len=32", "data.batch_size=2"]
STEPS = 400  # long enough for two `ray job stop`s (each a few seconds) before the run ends
RECIPE = {"RAY_AUTH_MODE": "token"}  # the README's `export RAY_AUTH_MODE=token` before `ray start` and `ray job`


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A shell of a user whose home is `home`: none of Ray's authentication or address variables of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "RAY_ADDRESS"))}
    return {**env, "HOME": str(home), **extra}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A user's home with the token `ray get-auth-token --generate` makes (as the README's recipe does)."""
    home = tmp_path_factory.mktemp("home")
    made = subprocess.run(
        [*RAY, "get-auth-token", "--generate"],
        capture_output=True,
        text=True,
        timeout=120,
        env=user_env(home, **RECIPE),
    )
    assert made.returncode == 0 and (home / ".ray" / "auth_token").is_file(), made.stderr
    return home


@pytest.fixture(scope="module")
def job_head(home: Path):
    """(job server URL, GCS address) of a head started as the README says, token authentication on; its temp
    dir is short (Unix socket paths are limited)."""
    from megatrain.ipc.procs import descendants

    temp = tempfile.mkdtemp(prefix="mtjob", dir="/tmp")
    dash, gcs = free_port(), free_port()
    # Every port of its own: another Ray instance of the session (tests/conftest.py) holds the defaults,
    # and a job agent that cannot bind its port leaves the job server with "No available agent".
    ports = [
        f"--{name}={free_port()}"
        for name in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
            "ray-client-server-port",
        )
    ]
    proc = subprocess.Popen(
        [
            *RAY,
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            *ports,
            f"--dashboard-port={dash}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=8",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=user_env(home, **RECIPE, RAY_prestart_worker_first_driver="0"),  # no idle worker per CPU
    )
    address = f"http://127.0.0.1:{dash}"
    guard = guard_tree(proc.pid)
    try:
        # The job server answers before its agent on the head has registered ("No available agent to
        # submit job"): ready once a no-op job is taken.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and jobs(home, address, "submit", "--no-wait", "--", "true").returncode:
            assert proc.poll() is None, "ray start --head exited"
            time.sleep(1)
        yield address, f"127.0.0.1:{gcs}"
    finally:
        for pid in [proc.pid, *descendants([proc.pid])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        stop_guard(guard)
        shutil.rmtree(temp, ignore_errors=True)


def jobs(home: Path, address: str, verb: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`ray job VERB --address ADDRESS ARGS` as the README's recipe runs it (the address before `--`)."""
    return subprocess.run(
        [*RAY, "job", verb, "--address", address, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=user_env(home, **RECIPE),
    )


def submit(
    home: Path, address: str, sid: str, root: Path, *overrides: str, wait: bool = True
) -> subprocess.CompletedProcess:
    env = {"env_vars": {"MEGATRAIN_OUTPUT_ROOT": str(root), "RAY_JOB_STOP_WAIT_TIME_S": "120"}}
    return jobs(
        home,
        address,
        "submit",
        f"--submission-id={sid}",
        f"--working-dir={ROOT / 'examples'}",
        f"--runtime-env-json={json.dumps(env)}",
        *([] if wait else ["--no-wait"]),
        "--",
        sys.executable,
        "-m",
        "megatrain.launch.cli.main",
        "default.yaml",
        *overrides,
    )


def status(home: Path, address: str, sid: str) -> str:
    from ray.job_submission import JobSubmissionClient

    token = (home / ".ray" / "auth_token").read_text().strip()
    return str(JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"}).get_job_status(sid).value)


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def steps_in(out: Path) -> list[int]:
    metrics = out / "metrics.jsonl"
    return [json.loads(r)["step"] for r in metrics.read_text().splitlines()] if metrics.is_file() else []


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def stop_job(home: Path, head: str, sid: str, out: Callable[[], Path | None], after: int) -> str:
    """`ray job stop` once the job's run has recorded a step after `after`: STOPPED, a checkpoint, nothing of the
    run left. Returns the job's log."""

    def going() -> bool:
        o = out()
        if o is not None and max(steps_in(o), default=0) >= after + 2:
            return True
        state = status(home, head, sid)
        assert state in ("PENDING", "RUNNING"), f"{sid} {state}:\n" + jobs(home, head, "logs", sid).stdout[-3000:]
        return False

    wait_for(going, 240, f"{sid}'s steps")
    assert jobs(home, head, "stop", sid).returncode == 0
    wait_for(lambda: status(home, head, sid) == "STOPPED", 120, f"{sid} STOPPED")
    logs = jobs(home, head, "logs", sid).stdout
    assert "stopped by SIGTERM" in logs and (out() / "checkpoints" / "latest").exists(), logs[-3000:]
    run = re.search(r"run (\w+); output directory", logs)
    assert run, logs[-3000:]
    wait_for(lambda: not run_leftovers(run[1]), 30, "the stopped run's shared memory to go")
    return logs


def test_submit_logs_stop_resume_and_a_cluster_too_small(job_head: tuple[str, str], home: Path, tmp_path: Path):
    head, _ = job_head
    root = tmp_path / "runs"
    steps = f"train.steps={STEPS}"
    # A run that succeeds: a relative output_dir lands under MEGATRAIN_OUTPUT_ROOT, not in Ray's package cache.
    done = submit(home, head, "mtok", root, steps, "train.run_id=jobok", "train.output_dir=out/{run_id}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert status(home, head, "mtok") == "SUCCEEDED"
    logs = jobs(home, head, "logs", "mtok").stdout
    assert f"output directory {root / 'out' / 'jobok'}" in logs and f"done, {STEPS} steps" in logs
    assert "ETA" in logs and "\r" not in logs  # plain lines under a job, not a bar
    assert steps_in(root / "out" / "jobok") == list(range(1, STEPS + 1))

    # `ray job stop` of a job in the default output directory, a new runs/<run_id> on every launch: its log ends
    # with the entrypoint that resumes it, which names that directory.
    submit(home, head, "mtstop", root, steps, wait=False)
    logs = stop_job(home, head, "mtstop", lambda: next((p.parent for p in root.glob("runs/*/metrics.jsonl")), None), 0)
    (out,) = (root / "runs").iterdir()
    entrypoint = re.search(r"to resume from it, submit the job again with the entrypoint: (.*)$", logs, re.M)
    assert entrypoint, logs[-3000:]
    command = shlex.split(entrypoint[1])
    assert command == ["megatrain-launch", "default.yaml", steps, f"train.output_dir={out}"], command
    # That entrypoint, stopped again: now the same command resumes (its output directory is fixed) ...
    submit(home, head, "mtresume", root, *command[2:], wait=False)  # submit() gives default.yaml
    logs = stop_job(home, head, "mtresume", lambda: out, max(steps_in(out)))
    assert "the same command resumes from it" in logs, logs[-3000:]
    # ... and submitting it once more ends where the uninterrupted run ended, bit for bit.
    again = submit(home, head, "mtagain", root, *command[2:])
    assert again.returncode == 0 and status(home, head, "mtagain") == "SUCCEEDED", again.stdout[-3000:]
    assert "resuming from" in jobs(home, head, "logs", "mtagain").stdout
    assert losses(out) == losses(root / "out" / "jobok")
    assert list((root / "runs").iterdir()) == [out]

    # A cluster with fewer CPUs than the actors ask for: the job fails naming each role's need.
    small = submit(
        home,
        head,
        "mtsmall",
        root,
        "train.steps=2",
        "actors.num_packers=8",
        "ipc.weight_slabs=8",
        "launch.placement_timeout_s=3",
        "train.output_dir=out/{run_id}",
    )
    assert small.returncode != 0 and status(home, head, "mtsmall") == "FAILED"
    logs = jobs(home, head, "logs", "mtsmall").stdout
    assert "they need 11 CPUs on one node (store-owner 0, gpu-executor 1, adam-updater 1, packer-0 1" in logs
    assert "actors.num_packers" in logs and "Traceback" not in logs


def launch(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAUNCH, str(ROOT / "examples" / "default.yaml"), *SMALL, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_joining_with_address_sends_the_token_ray_start_found(
    job_head: tuple[str, str], home: Path, tmp_path: Path
) -> None:
    """RAY_AUTH_MODE not exported: Ray alone would send no token and fail after 20 s of InvalidAuthToken."""
    _, gcs = job_head
    run = launch(
        user_env(home), "--address", gcs, "train.steps=2", "train.run_id=joined", f"train.output_dir={tmp_path / 'out'}"
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "done, 2 steps" in run.stdout and "InvalidAuthToken" not in run.stderr


@pytest.mark.parametrize(
    "case, says",
    [
        ("wrong token", "the cluster refused this machine's Ray token"),
        ("no token", "the cluster requires Ray's token authentication; export RAY_AUTH_MODE=token"),
        ("token mode, no token", "RAY_AUTH_MODE is token but this machine has no Ray token"),
        ("token path naming no file", "RAY_AUTH_TOKEN_PATH is set but file cannot be opened or is empty"),
    ],
)
def test_a_join_refused_for_authentication_says_so_in_one_line(
    job_head: tuple[str, str], tmp_path: Path, case: str, says: str
) -> None:
    _, gcs = job_head
    env = user_env(tmp_path)  # a home without a token
    if case == "wrong token":
        env["RAY_AUTH_TOKEN"] = "0" * 32
    elif case == "token mode, no token":
        env["RAY_AUTH_MODE"] = "token"
    elif case == "token path naming no file":
        env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "no-such-token")
    run = launch(env, "--address", gcs, f"train.output_dir={tmp_path / 'out'}")
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr.count("\n") == 1 and "authentication failed" in run.stderr and says in run.stderr, run.stderr
    assert f"--address / launch.address '{gcs}'" in run.stderr
    assert "`ray get-auth-token` on its head" in run.stderr or case == "token path naming no file"


def test_a_local_instance_refused_for_its_token_file_says_so_in_one_line(tmp_path: Path) -> None:
    run = launch(
        user_env(tmp_path, RAY_AUTH_TOKEN_PATH=str(tmp_path / "no-such-token")), f"train.output_dir={tmp_path / 'out'}"
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr[-3000:]
    assert (
        "cannot start a local Ray instance: authentication failed: RAY_AUTH_TOKEN_PATH is set but file cannot "
        f"be opened or is empty: {tmp_path / 'no-such-token'}" in run.stderr
    )


def test_a_local_run_shows_no_token_warning_and_no_cpu_tflops(tmp_path: Path) -> None:
    """A private instance keeps Ray's token authentication without announcing it; the CPU's progress lines
    carry tokens/s, not a TFLOPS figure of 0.0."""
    run = launch(
        user_env(tmp_path / "home"), "train.steps=2", "train.progress=lines", f"train.output_dir={tmp_path / 'out'}"
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    output = run.stdout + run.stderr
    assert "Token authentication" not in output and "WARNING" not in output, output[-3000:]
    lines = [line for line in run.stdout.splitlines() if "step 2/2" in line]
    assert len(lines) == 1 and "tok/s" in lines[0] and "TFLOPS" not in lines[0], run.stdout[-2000:]
