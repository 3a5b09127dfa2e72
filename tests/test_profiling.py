"""The layer-loop sync check: the detector on a synthetic trace, and (GPU only) on real CUDA work."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from megatrain.step.profiling import LOOP, StepProfile, blocking_calls
from tests.harness import requires_cuda


def _x(name: str, cat: str, tid: int, ts: float, dur: float = 1.0) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "tid": tid, "ts": ts, "dur": dur}


def test_blocking_calls_counts_only_blocking_calls_inside_the_loop_by_thread() -> None:
    trace = {
        "traceEvents": [
            _x(LOOP, "gpu_user_annotation", 7, 90, 300),  # the GPU-side copy of the range: not the loop
            _x(LOOP, "user_annotation", 1, 100, 100),
            _x("cudaLaunchKernel", "cuda_runtime", 1, 110),
            _x("cudaMemcpyAsync", "cuda_runtime", 1, 120),  # asynchronous: not blocking
            _x("cudaStreamSynchronize", "cuda_runtime", 1, 150),  # .item() in the loop: a violation
            _x("cudaEventSynchronize", "cuda_runtime", 2, 160),  # the loader's slab hand-off
            _x("cudaStreamSynchronize", "cuda_runtime", 1, 250),  # the loss read after the loop
            _x("cudaDeviceSynchronize", "cuda_runtime", 1, 50),  # before the loop
            {"ph": "i", "name": "cudaStreamSynchronize", "cat": "cuda_runtime", "tid": 1, "ts": 130},
        ]
    }
    assert blocking_calls(trace) == {
        "loop_blocking_calls": 1,
        "loop_blocking_names": ["cudaStreamSynchronize"],
        "helper_thread_blocking_calls": 1,
        "loop_runtime_calls": 3,
    }
    with pytest.raises(ValueError, match=LOOP):
        blocking_calls({"traceEvents": trace["traceEvents"][:1] + trace["traceEvents"][2:]})


def test_step_profile_writes_a_trace_with_the_loop_range(tmp_path: Path) -> None:
    with StepProfile(tmp_path / "p" / "trace.json", cuda=False) as prof, prof.loop():
        torch.ones(64).mul_(2).sum()
    res = prof.result()
    assert Path(res["profile_trace"]).is_file() and res["loop_blocking_calls"] == 0


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("sync", [False, True])
def test_detector_sees_an_item_in_a_cuda_loop(tmp_path: Path, sync: bool) -> None:
    x = torch.ones(1 << 20, device="cuda")
    with StepProfile(tmp_path / "trace.json", cuda=True) as prof:
        with prof.loop():
            for _ in range(8):
                x = x * 1.0001
                if sync:
                    x.sum().item()
        float(x.sum())  # after the loop: allowed
    res = prof.result()
    assert res["loop_runtime_calls"] >= 8  # the launches are attributed to the loop's thread
    assert (res["loop_blocking_calls"] >= 8) == sync and (res["loop_blocking_calls"] == 0) == (not sync)


# ---- a CPU actor sampled by py-spy over one step (train.profile.actor) --------------------------------
def _profiled_run(tmp_path: Path, rid: str, actor: str, capsys, *extra: str) -> tuple[Path, str]:
    import json

    from megatrain.launch.config.tree import load_config
    from megatrain.launch.run.driver import Trainer
    from tests.harness import TINY

    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    out = tmp_path / "out"
    cfg = load_config(
        None,
        [
            f"model.hf={hf}",
            "data.seq_len=32",
            "data.batch_size=2",
            "train.steps=4",
            "train.profile.step=3",
            f"train.profile.actor={actor}",
            f"train.run_id={rid}",
            f"train.output_dir={out}",
            "launch.runner=inprocess",
            *extra,
        ],
    )
    Trainer(cfg).run()
    return out, capsys.readouterr().out


def _py_spy() -> str:
    import shutil

    exe = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("py-spy is not installed (pip install 'megatrain[profile]')")
    return exe


def _rounds(pid: int) -> int:
    """How often py-spy (pid `pid`) has slept between its samples: the voluntary context switches of its busiest
    thread beside the main one (the main thread collects what the sampling thread sends it). On time, the
    sampling thread sleeps once a round; behind (a loaded machine), it samples without sleeping, so this counts
    fewer rounds than it made, never more, but for a rare block in a round."""
    counts = [0]
    for tid in os.listdir(f"/proc/{pid}/task"):
        if tid == str(pid):
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                counts += [int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches")]
        except OSError:  # a thread that ended since the listing
            pass
    return max(counts)


SAMPLE_ROUNDS = 10  # py-spy's sampling rounds that each piece of Adam's work outlasts (4 pieces: 40 or more)


def _adam_at_work(pyspy: int) -> None:
    """Python work py-spy can see, in Adam's thread, until py-spy (pid `pyspy`) has gone round its sampling
    loop SAMPLE_ROUNDS times since it began: as long as a loaded machine needs, not a set time."""
    start, deadline = _rounds(pyspy), time.monotonic() + 120  # only a py-spy that hangs without exiting
    while _rounds(pyspy) - start < SAMPLE_ROUNDS and time.monotonic() < deadline:
        end = time.perf_counter() + 0.005  # Python work between looks at py-spy's threads
        while time.perf_counter() < end:
            sum(range(1000))


def test_a_cpu_actor_is_sampled_over_its_step(tmp_path: Path, rid: str, capsys, monkeypatch) -> None:
    """The actor's sampler was sampling before step 3 began (start() returns once py-spy says it samples) and
    wrote its file after the step: the log line says both. The window gathers Adam's update of step 2 (which
    overlaps step 3): each of its pieces waits for the sampler to sample, then works in Python until py-spy
    has gone round many times, however slowly a loaded machine runs it. So the file must hold samples of
    Adam's thread in that work, called from the updater's code: the process that runs the adam-updater,
    sampled while it updated."""
    import functools
    import json
    import threading

    from megatrain.actors.adam_updater import AdamUpdater
    from megatrain.actors.base import Role

    real_update, real_start = AdamUpdater._update, Role.profile_start
    started, said = threading.Event(), []  # the sampler's start has returned, and what it said ('': sampling)
    worked: list[int] = []  # the units whose step-2 update worked while py-spy sampled

    @functools.wraps(real_start)  # the crew calls it by its name
    def profile_start(self, path):  # noqa: ANN001, ANN202
        said.append(real_start(self, path))
        started.set()
        return said[-1]

    def update(self, unit, lo, hi, g, t, lr, scale, spare=False):  # noqa: ANN001
        # step 2's update runs (its pieces wait here) until the window that gathers it has py-spy sampling
        if t == 2 and started.wait(120) and said == [""]:
            _adam_at_work(self.sampler.proc.pid)
            worked.append(unit)
        real_update(self, unit, lo, hi, g, t, lr, scale, spare)

    _py_spy()
    monkeypatch.setattr(Role, "profile_start", profile_start)
    monkeypatch.setattr(AdamUpdater, "_update", update)
    # Adam is held as long as py-spy needs: on a loaded machine, longer than the stall monitor's 15 s
    out, log = _profiled_run(tmp_path, rid, "adam-updater", capsys, "ipc.stall_timeout_s=0")
    trace = out / "profiles" / "adam-updater-step-3.speedscope.json"
    assert f"profiled adam-updater during step 3 with py-spy into {trace}" in log
    data = json.loads(trace.read_text())
    assert "speedscope" in data["$schema"] and data["exporter"].startswith("py-spy")
    frames = data["shared"]["frames"]
    stacks = [[frames[f] for f in sample] for prof in data["profiles"] for sample in prof["samples"]]
    working = [s for s in stacks if any(f["name"] == "_adam_at_work" for f in s)]
    assert worked, "no piece of Adam's step-2 update worked while py-spy sampled"
    assert working, f"none of {len(stacks)} samples in Adam's work ({len(worked)} pieces worked while sampled)"
    assert all(any(f.get("file", "").endswith("actors/adam_updater.py") for f in s) for s in working)
    assert not (out / "profile-step-3.json").exists()  # the executor was not profiled


def _busy(stop) -> None:  # noqa: ANN001
    while not stop.is_set():
        sum(range(1000))


def test_the_sampler_catches_what_runs_while_it_samples(tmp_path: Path) -> None:
    """start() returns only once py-spy samples; a thread busy from then on for 250 sample periods (one a
    sampler that had not attached yet would miss whole, as the old fixed one-second wait could on a busy
    node) is in the file stop() writes, with its function's frames."""
    import json
    import threading
    import time

    from megatrain.ipc.sampler import RATE, Sampler

    _py_spy()
    sampler, stop = Sampler(), threading.Event()
    assert sampler.start(str(tmp_path / "p.json")) == ""
    worker = threading.Thread(target=_busy, args=(stop,), name="busy-worker")
    worker.start()
    time.sleep(250 / RATE)  # a window for a sampler that is already sampling, not a wait for it
    stop.set()
    worker.join()
    assert sampler.stop() == "" and "Samples:" in sampler.said
    data = json.loads((tmp_path / "p.json").read_text())
    names = {f["name"] for f in data["shared"]["frames"]}
    assert "_busy" in names and any("busy-worker" in prof["name"] for prof in data["profiles"])


def _fake_py_spy(tmp_path: Path, script: str, monkeypatch) -> None:
    """A py-spy on PATH that does what `script` says (the real one cannot be made to fail on demand)."""
    exe = tmp_path / "bin" / "py-spy"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\n{script}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}")


def test_a_py_spy_that_cannot_attach_is_named_with_its_error(tmp_path: Path, monkeypatch) -> None:
    from megatrain.ipc.sampler import Sampler

    _fake_py_spy(
        tmp_path,
        "echo 'Error: Operation not permitted (os error 1)'; echo 'Stack backtrace:'; "
        "echo '   0: anyhow::error'; exit 1",
        monkeypatch,
    )
    sampler = Sampler()
    why = sampler.start(str(tmp_path / "p.json"))
    assert why == "py-spy exited at once: Error: Operation not permitted (os error 1)"
    assert sampler.proc is None and sampler.stop() == "no sampler was running"


def test_a_py_spy_that_never_samples_is_ended(tmp_path: Path, monkeypatch) -> None:
    import subprocess

    import psutil

    from megatrain.ipc import sampler as sampling

    made: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):  # the real Popen, remembered so the test can check what became of it
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            made.append(self)

    _fake_py_spy(tmp_path, "exec sleep 600", monkeypatch)
    monkeypatch.setattr(sampling.subprocess, "Popen", Recorded)
    monkeypatch.setattr(sampling, "START_S", 0.5)  # it never says it samples: this only bounds the test
    assert sampling.Sampler().start(str(tmp_path / "p.json")) == "py-spy did not start sampling in 0.5 s"
    assert len(made) == 1 and made[0].returncode is not None and not psutil.pid_exists(made[0].pid)  # reaped


def test_an_actor_the_run_does_not_have_is_named_and_nothing_is_profiled(tmp_path: Path, rid: str, capsys) -> None:
    out, log = _profiled_run(tmp_path, rid, "packer-5", capsys)
    assert "this run has no actor 'packer-5'" in log and "nothing profiled" in log
    assert not (out / "profiles").exists()


def test_nvtx_ranges_follow_the_engines_phase_marks(monkeypatch) -> None:
    """A real step's marks give one balanced NVTX range per phase, in mark order ('end' closes the last); a
    step that raises leaves no range open once closed."""
    from megatrain.data import DataConfig, batch
    from megatrain.ipc.protocol import blocks
    from megatrain.step.engine import EngineConfig, StepEngine
    from megatrain.step.profiling import NvtxPhases
    from tests.model_fixtures import DictSink, DictSource, spec_for, tiny_hf

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"+{name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("-"))
    model = tiny_hf("llama", False, layers=4)
    spec = spec_for(model, "llama")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    names: list[str] = []
    phases = NvtxPhases()

    def mark(name: str) -> None:
        names.append(name)
        phases(name)

    engine = StepEngine(
        spec,
        EngineConfig(checkpoint_interval=2, last_block_layers=1, chunk_sequences=1),
        torch.device("cpu"),
        torch.float32,
    )
    engine.step(
        *batch(DataConfig(seq_len=16, batch_size=2), 0),
        DictSource(spec, state, blocks=blocks(4, 2, 1)),
        DictSink(),
        mark,
    )
    assert names[0] == "forward" and names[-1] == "end" and "recompute:1" in names and "bwd:1" in names
    want = [c for n in names[:-1] for c in ("-", f"+{n}")][1:] + ["-"]
    assert calls == want and not phases.open
    calls.clear()
    phases("fwd:1")
    phases.close()  # as the executor does when a step raises
    assert calls == ["+fwd:1", "-"] and not phases.open


@pytest.mark.parametrize("value, msg", [("default", "needs launch.runner 'ray'"), ("always", "mapping of nsys")])
def test_launch_nsight_is_checked_where_it_is_set(value: str, msg: str) -> None:
    from megatrain.launch.config.tree import load_config

    runner = ["launch.runner=inprocess"] if "runner" in msg else []
    with pytest.raises(Exception, match=msg) as info:
        load_config(None, [f"launch.nsight={value}", *runner])
    assert "launch.nsight" in str(info.value)
    cfg = load_config(None, ['launch.nsight={"t": "cuda,nvtx", "o": "executor"}'])
    assert cfg.launch.nsight == {"t": "cuda,nvtx", "o": "executor"}


def test_launch_nsight_without_nsys_is_refused_before_the_executor_starts(monkeypatch) -> None:
    """Only the gpu-executor runs under nsys; a local node without it gets a config error naming the key."""
    import shutil

    from megatrain.errors import ConfigError
    from megatrain.launch.config.tree import load_config
    from megatrain.launch.control.placement import Demand
    from megatrain.launch.control.runners import RayRunner

    monkeypatch.setattr(shutil, "which", lambda name: None)
    runner = RayRunner(load_config(None, ["launch.nsight=default"]).launch)
    runner.started_ray = True
    with pytest.raises(ConfigError, match="launch.nsight: nsys"):
        runner.spawn("gpu-executor", object, (), Demand(1, 1))
