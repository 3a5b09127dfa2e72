"""The launcher as users run it: separate processes, clean exits, clear errors, nothing left behind
after success, bad input, a killed actor, or Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatrain.formats import checkpoint as ckpt
from tests.harness import NO_AUTH, ROOT, SMALL, Cli, guard_tree, sleeps_seen, stop_guard, wait_until


def test_bad_config_key_is_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: 1.0e-3\n  lrr: 2.0e-3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "megatrain.launch.cli.main", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2  # a usage error
    assert f"{bad}:3" in proc.stderr and "optim.lrr" in proc.stderr and "did you mean 'optim.lr'" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bad_override_names_the_command_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatrain.launch.cli.main",
            str(ROOT / "examples/default.yaml"),
            "engine.checkpoint_interval=0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "checkpoint_interval" in proc.stderr and "Traceback" not in proc.stderr


# No idle worker per CPU for the first driver (as the launcher's own local instance): on 2 cores their
# imports would slow every link's actors.
NO_PRESTART = {"RAY_prestart_worker_first_driver": "0"}


@pytest.fixture
def head_node(tmp_path: Path):
    """A `ray start --head` cluster of this test's own, ended by pid (its whole process tree) afterwards."""
    from megatrain.ipc.procs import descendants

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=8",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **NO_AUTH, **NO_PRESTART},
    )
    guard = guard_tree(proc.pid)
    try:
        deadline = time.monotonic() + 300  # a bound for a hung start only: a busy machine starts Ray slowly
        while proc.poll() is None and time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError(f"ray start --head did not listen on {port} (exit {proc.poll()})")
        yield f"127.0.0.1:{port}"
    finally:
        tree = [proc.pid, *descendants([proc.pid])]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        stop_guard(guard)


# ---- one run, stopped and killed again and again, resumed each time --------------------------------
# Through Ray, with a checkpoint after every step, ~0.25 s a step on 2 cores: each link catches a checkpoint being
# written within its first steps (and resumes from the last complete one), so the last run trains nearly all of them.
STEPS = 100
# Threads pinned, so the uninterrupted reference can run in-process (2 s instead of a Ray start).
CHAIN = [
    "train.save_every=1",
    "actors.adam_threads=1",
    "actors.accumulator_threads=1",
    "actors.executor_threads=1",
    f"train.profile.step={STEPS}",
]
# Each link: who is SIGKILLed in the middle of a checkpoint write (several at the same instant); a
# driver joined to a `ray start` cluster; or a signal.
LINKS = [
    ("ctrl-c",),
    ("gpu-executor", "packer-0", "grad-accumulator-0"),
    ("sigstop",),
    ("adam-updater", "checkpoint-writer", "store-owner"),
    ("driver",),
    ("driver-joined",),
    ("sigterm-twice",),
]


def freeze_mid_write(cli: Cli, writer: int) -> Path:
    """Wait until this writer is writing a checkpoint (a torn one of an earlier run may lie beside it)
    while a complete one exists, then SIGSTOP it inside the write: that write can never complete, so
    the kill that follows leaves a torn checkpoint behind, deterministically."""
    root = cli.out / "checkpoints"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and cli.proc.poll() is None:
        names = os.listdir(root) if root.is_dir() else []
        # The step's directory of every host's part, with this writer's part still being written in it.
        torn = [root / n for n in names if n.endswith(".tmp-hosts") and (root / n / f"host-0.tmp-{writer}").is_dir()]
        if torn and "latest" in names:
            os.kill(writer, signal.SIGSTOP)
            if all((t / f"host-0.tmp-{writer}").exists() for t in torn):  # not renamed between the look and the stop
                return torn[0]
            os.kill(writer, signal.SIGCONT)
    raise AssertionError(f"never saw a checkpoint being written:\n{cli.text()}")


def kill_mid_write(cli: Cli, victims: tuple[str, ...]) -> None:
    pids = cli.actor_pids()
    cli.snapshot()  # before the writer is frozen: the kill follows the freeze at once
    torn = freeze_mid_write(cli, pids["checkpoint-writer"])
    for v in victims:
        os.kill(cli.proc.pid if v.startswith("driver") else pids[v], signal.SIGKILL)
    # Promptly: the death itself is reported, not a peer's wait running out (ipc.wait_timeout_s is 600 s, and
    # finish() gives the launcher 90 s), whatever the machine's load makes of the seconds in between.
    rc = cli.finish(timeout=90)
    if not victims[0].startswith("driver"):
        err = "".join(cli.stderr)
        assert rc == 1 and "died" in err and any(f"actor '{v}'" in err for v in victims), cli.text()
        assert "WaitTimeout" not in err, cli.text()
    cli.assert_clean()
    step = int(torn.name.split(".")[0].removeprefix("step-"))
    done = [s for s, _ in ckpt.complete(cli.out / "checkpoints")]
    assert done and all(s < step for s in done), (torn, done)  # never taken for a complete one
    # The launcher's end removes the write it cut short; a killed launcher has none: its next start removes it.
    assert torn.is_dir() == victims[0].startswith("driver"), (torn, victims, list(torn.parent.iterdir()))


def stopped_actor(cli: Cli) -> None:
    """SIGSTOP: the process neither dies nor raises; its peers wait on it. The monitor must name it (from
    its heartbeat), not a peer that times out waiting, and long before ipc.wait_timeout_s (600 s). With
    the default ipc.stall_timeout_s (15 s, test_config checks it) that is within 30 s; here 5 s."""
    pids = cli.actor_pids()
    cli.wait_for(r"checkpoint after step \d+")
    cli.snapshot()
    os.kill(pids["adam-updater"], signal.SIGSTOP)
    # The monitor's verdict, from the heartbeat: no peer's wait (600 s) can have run out within wait_for's bound,
    # and none is reported (how many seconds the verdict takes is ipc.stall_timeout_s plus the machine's load).
    cli.wait_for(r"stalled: actor 'adam-updater'.*stopped running", timeout=90)
    assert cli.finish(timeout=90) == 1, cli.text()
    err = "".join(cli.stderr)
    assert "stalled: actor 'adam-updater'" in err and "stopped running" in err, cli.text()
    assert "WaitTimeout" not in err, cli.text()
    cli.assert_clean()


def stop_by_signal(cli: Cli, how: str) -> None:
    """Ctrl-C to the process group: the step finishes, a checkpoint, exit 130. SIGTERM twice: the second
    lands while the stop's checkpoint is written (a checkpoint after every step) and ends it at once."""
    cli.actor_pids()
    cli.wait_for(r"checkpoint after step \d+")
    cli.snapshot()
    before = len(ckpt.complete(cli.out / "checkpoints"))
    if how == "ctrl-c":
        os.killpg(cli.proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
        assert cli.finish(timeout=90) == 128 + signal.SIGINT, cli.text()
        assert len(ckpt.complete(cli.out / "checkpoints")) > before, cli.text()
    else:
        os.kill(cli.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 120  # two signals at once would merge into one: wait for the first's word
        while "finishing the current step" not in "".join(cli.stderr):
            assert time.monotonic() < deadline and cli.proc.poll() is None, cli.text()
            time.sleep(0.01)
        os.kill(cli.proc.pid, signal.SIGTERM)
        assert cli.finish(timeout=90) == 128 + signal.SIGTERM, cli.text()
        assert "interrupted" in "".join(cli.stderr), cli.text()
    cli.assert_clean()


@pytest.mark.slow
def test_one_run_stopped_and_killed_mid_checkpoint_resumes_bit_identical(tmp_path: Path, head_node: str) -> None:
    """Through Ray, one process per actor. The same run is stopped by Ctrl-C; SIGKILLed in the middle
    of a checkpoint write (the executor, a packer and an accumulator at once); stopped by a SIGSTOPped
    Adam updater (named by the monitor); SIGKILLed mid-write again (the Adam updater, the checkpoint
    writer and the store owner at once; the local driver; a driver joined to a `ray start` cluster);
    stopped by two SIGTERMs; and resumed (train.resume: auto) after each. Every time: the exit code,
    the dead or stopped actor named, nothing left running or in /dev/shm, a torn checkpoint never taken
    for a complete one. At the end the run finishes in its own processes and
    equals an uninterrupted run bit for bit: every loss, every weight and both Adam moments."""
    from megatrain.launch.config.tree import load_config
    from megatrain.launch.run.driver import Trainer

    ref = tmp_path / "ref"
    Trainer(
        load_config(
            ROOT / "examples/default.yaml",
            [*SMALL, *CHAIN, f"train.steps={STEPS}", f"train.output_dir={ref}", "launch.runner=inprocess"],
        )
    ).run()
    joined = ["--address", head_node]  # no Ray start per link; the local driver's link starts its own
    for link in LINKS:
        # The SIGSTOPped Adam updater is named by the monitor within 5 s. Where the test freezes the writer only to
        # tear a checkpoint, the deaths must be what is reported, however long a busy machine takes to notice
        # them: the writer's own stall verdict is put out of their way.
        extra = (
            ["ipc.stall_timeout_s=5"]
            if link == ("sigstop",)
            else ["ipc.stall_timeout_s=300"]
            if link[0] not in ("ctrl-c", "sigterm-twice")
            else []
        )
        cli = Cli(tmp_path / "run", *CHAIN, *extra, *([] if link == ("driver",) else joined), steps=STEPS, env=NO_AUTH)
        if link == ("sigstop",):
            stopped_actor(cli)
        elif link[0] in ("ctrl-c", "sigterm-twice"):
            stop_by_signal(cli, link[0])
        else:
            kill_mid_write(cli, link)
    last = Cli(tmp_path / "run", *CHAIN, *joined, steps=STEPS, env=NO_AUTH)
    pids = last.actor_pids()
    assert last.finish() == 0, last.text()
    roles = ["gpu-executor", "packer-0", "grad-accumulator-0", "adam-updater", "checkpoint-writer", "store-owner"]
    assert len({pids[r] for r in roles} | {last.proc.pid}) == len(roles) + 1, pids  # a process each
    assert "resuming from" in "".join(last.stdout), last.text()
    root, want = last.out / "checkpoints", ref / "checkpoints"
    assert not list(root.glob("*.tmp-*"))  # the start removed what a killed launcher's write left
    for part in ckpt.PLANES:
        a = (ckpt.step_dir(root, STEPS) / "host-0" / f"{part}.bin").read_bytes()
        assert a == (ckpt.step_dir(want, STEPS) / "host-0" / f"{part}.bin").read_bytes(), part
    rows = [json.loads(line) for line in (last.out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [
        (r["step"], r["loss"]) for r in map(json.loads, (ref / "metrics.jsonl").read_text().splitlines())
    ]
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "step_time_s"):
        assert all(key in r for r in rows), key
    assert "run_id: " + last.run_id in (last.out / "config.yaml").read_text()
    # The profiled step: a Chrome trace, and no host-blocking call in the layer loop (none on the CPU device).
    trace = (last.out / f"profile-step-{STEPS}.json").resolve()
    assert rows[-1]["profile_trace"] == str(trace) and rows[-1]["loop_blocking_calls"] == 0
    assert json.loads(trace.read_text())["traceEvents"] and "profile_trace" not in rows[-2]
    last.assert_clean()


def test_the_cleanup_command_removes_a_dead_runs_segments_and_keeps_a_live_ones(tmp_path: Path) -> None:
    """`megatrain-launch --cleanup` as a command of its own (tests/test_segments.py holds every kind through
    cli.main): a dead owner's segments and semaphore go and are named, a live owner's (this process) stay."""
    from megatrain.ipc.procs import start_ticks
    from tests.shm_fixtures import dead_pid, header, put

    dead, alive, me = "dead" + secrets.token_hex(3), "live" + secrets.token_hex(3), os.getpid()
    gone = [f"megatrain-{dead}-ctl", f"megatrain-{dead}-params", f"sem.megatrain-{dead}-sem-wfree0"]
    pid = dead_pid()
    for name in gone[:2]:
        put(tmp_path, name, header(dead, pid=pid))
    put(tmp_path, gone[2], b"")
    kept = put(tmp_path, f"megatrain-{alive}-ctl", header(alive, pid=me, ticks=start_ticks(me)))
    proc = subprocess.run(
        [sys.executable, "-m", "megatrain.launch.cli.main", "--cleanup", "--shm-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.name]
    said = proc.stdout.splitlines()
    assert said[0] == f"megatrain-launch: removed 3 shared-memory objects left over in {tmp_path}:", proc.stdout
    assert sorted(line.strip() for line in said[1:4]) == sorted(gone) and len(said) == 4, proc.stdout


def test_the_guard_leaves_a_detached_watchdog_alone(monkeypatch) -> None:
    """A process of the instance starts a watchdog in a session of its own (as spawn_detached does for the
    store owner's reaper), here kept as its child, so that every look of the guard finds it in the instance's
    tree: the guard tracks the process, never the watchdog, and ends what it tracks once the driver is gone."""
    from megatrain.launch.control import guard as watch
    from megatrain.launch.control.guard import Guard

    code = (
        "import subprocess, sys, time; "
        "w = subprocess.Popen([sys.executable, '-m', 'timeit', '-n', '1', 'import time; time.sleep(60)'], "
        "start_new_session=True); print(w.pid, flush=True); time.sleep(60)"
    )
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    watchdog = 0
    looks: list[bool] = []  # each of the guard's looks at the watchdog: whether it found it detached
    detached = watch._detached

    def seen(pid: int) -> bool:  # the guard's own check, its answers on the watchdog recorded
        found = detached(pid)
        if pid == watchdog:
            looks.append(found)
        return found

    monkeypatch.setattr(watch, "_detached", seen)
    try:
        guard = Guard(driver.pid, _ticks(driver.pid), [root.pid])
        following = threading.Thread(target=guard.follow)
        following.start()
        watchdog = int(root.stdout.readline())
        assert wait_until(lambda: len(looks) >= 2), "the guard never looked at the watchdog"  # two of its looks
        driver.kill()
        driver.wait()
        following.join(10)
        assert all(looks) and root.pid in guard.tracked and watchdog not in guard.tracked, (watchdog, guard.tracked)
        assert root.pid in guard.end_all()
        assert psutil.pid_exists(watchdog) and psutil.Process(watchdog).status() != "zombie"
    finally:
        for p in (driver, root):
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(10)
        if watchdog:
            with contextlib.suppress(ProcessLookupError):
                os.kill(watchdog, signal.SIGKILL)


def _ticks(pid: int) -> int:
    from megatrain.ipc.procs import start_ticks

    return start_ticks(pid)


def test_the_launcher_leaves_once_its_inputs_read_has_ended() -> None:
    """A refused placement ends a run while its inputs are still read on their thread: the launcher waits for
    that read before it returns (a thread still importing as the interpreter exits races its exit handlers),
    up to a limit, and not once a signal asks it out."""
    from megatrain.launch.run.stopping import Background, settle_reads

    ended: list[bool] = []
    Background(lambda: (time.sleep(1.0), ended.append(True)), name="inputs")
    assert settle_reads(10.0) and ended

    release = threading.Event()
    held = Background(release.wait, name="inputs")
    began = time.monotonic()
    # the limit ends the wait for a read never released (the bound: a loaded machine's lateness, not the limit's)
    assert not settle_reads(0.3) and time.monotonic() - began < 30.0
    assert not settle_reads(30.0, stop=lambda: True)  # a signal came: no wait
    release.set()
    assert settle_reads(5.0) and held.result() is True


def test_the_launcher_returns_after_a_read_in_flight_has_ended() -> None:
    """The launcher's own exit path: an error returned (exit 2 here) still waits for the read beside it."""
    from megatrain.launch.cli.main import main
    from megatrain.launch.run.stopping import Background

    ended: list[bool] = []
    Background(lambda: (time.sleep(1.5), ended.append(True)), name="inputs")
    assert main([str(ROOT / "examples/default.yaml"), "train.no_such_key=1"]) == 2
    assert ended


def test_a_tree_a_test_started_dies_with_the_test_process() -> None:
    """The head_node fixture's watchdog (tests/harness.py guard_tree): a process that started a tree in a session
    of its own (as `ray start --head --block`) and is then SIGKILLed before any cleanup takes the tree with it."""
    code = (
        "import subprocess, sys, time\n"
        "from tests.harness import guard_tree\n"
        "tree = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "print(tree.pid, guard_tree(tree.pid), flush=True)\n"
        "time.sleep(300)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    tree, watchdog = map(int, owner.stdout.readline().split())
    try:
        # the watchdog's first two looks, the owner alive: the tree stays
        assert sleeps_seen(watchdog, 2), "the watchdog exited with the process that started it alive"
        assert Path(f"/proc/{tree}").exists()
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(tree):
            time.sleep(0.2)
        assert not _alive(tree), "the tree outlived the process that started it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(tree, signal.SIGKILL)
        owner.kill()


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
