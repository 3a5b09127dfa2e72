"""The layer-loop sync check: the detector on a synthetic trace, and (GPU only) on real CUDA work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatrain.profiling import LOOP, StepProfile, blocking_calls
from tests.helpers import requires_cuda


def _x(name: str, cat: str, tid: int, ts: float, dur: float = 1.0) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "tid": tid, "ts": ts, "dur": dur}


def test_blocking_calls_counts_only_blocking_calls_inside_the_loop_by_thread() -> None:
    trace = {"traceEvents": [
        _x(LOOP, "gpu_user_annotation", 7, 90, 300),  # the GPU-side copy of the range: not the loop
        _x(LOOP, "user_annotation", 1, 100, 100),
        _x("cudaLaunchKernel", "cuda_runtime", 1, 110),
        _x("cudaMemcpyAsync", "cuda_runtime", 1, 120),  # asynchronous: not blocking
        _x("cudaStreamSynchronize", "cuda_runtime", 1, 150),  # .item() in the loop: a violation
        _x("cudaEventSynchronize", "cuda_runtime", 2, 160),  # the loader's slab hand-off
        _x("cudaStreamSynchronize", "cuda_runtime", 1, 250),  # the loss read after the loop
        _x("cudaDeviceSynchronize", "cuda_runtime", 1, 50),  # before the loop
        {"ph": "i", "name": "cudaStreamSynchronize", "cat": "cuda_runtime", "tid": 1, "ts": 130},
    ]}
    assert blocking_calls(trace) == {"loop_blocking_calls": 1, "loop_blocking_names": ["cudaStreamSynchronize"],
                                     "helper_thread_blocking_calls": 1, "loop_runtime_calls": 3}
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
def _profiled_run(tmp_path: Path, rid: str, actor: str, capsys) -> tuple[Path, str]:
    import json

    from megatrain.launch.config import load_config
    from megatrain.launch.driver import Trainer

    from tests.helpers import TINY

    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    out = tmp_path / "out"
    cfg = load_config(None, [f"model.hf={hf}", "data.seq_len=32", "data.batch_size=2", "train.steps=4",
                             "train.profile.step=3", f"train.profile.actor={actor}", f"train.run_id={rid}",
                             f"train.output_dir={out}", "launch.runner=inprocess"])
    Trainer(cfg).run()
    return out, capsys.readouterr().out


def test_a_cpu_actor_is_sampled_over_its_step(tmp_path: Path, rid: str, capsys) -> None:
    import json
    import shutil

    if shutil.which("py-spy") is None and shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("py-spy is not installed (pip install 'megatrain[profile]')")
    out, log = _profiled_run(tmp_path, rid, "adam-updater", capsys)
    trace = out / "profiles" / "adam-updater-step-3.speedscope.json"
    assert f"profiled adam-updater during step 3 with py-spy into {trace}" in log
    data = json.loads(trace.read_text())
    assert "speedscope" in data["$schema"] and data["shared"]["frames"]
    assert not (out / "profile-step-3.json").exists()  # the executor was not profiled


def test_an_actor_the_run_does_not_have_is_named_and_nothing_is_profiled(tmp_path: Path, rid: str, capsys) -> None:
    out, log = _profiled_run(tmp_path, rid, "packer-5", capsys)
    assert "this run has no actor 'packer-5'" in log and "nothing profiled" in log
    assert not (out / "profiles").exists()


def test_nvtx_ranges_follow_the_engines_phase_marks(monkeypatch) -> None:
    """A real step's marks give one balanced NVTX range per phase, in mark order ('end' closes the last); a
    step that raises leaves no range open once closed."""
    from megatrain.ipc.protocol import blocks

    from megatrain.data import DataConfig, batch
    from megatrain.engine import EngineConfig, StepEngine
    from megatrain.profiling import NvtxPhases
    from tests.helpers import DictSink, DictSource, spec_for, tiny_hf

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

    engine = StepEngine(spec, EngineConfig(checkpoint_interval=2, last_block_layers=1, chunk_sequences=1),
                        torch.device("cpu"), torch.float32)
    engine.step(*batch(DataConfig(seq_len=16, batch_size=2), 0), DictSource(spec, state, blocks=blocks(4, 2, 1)),
                DictSink(), mark)
    assert names[0] == "forward" and names[-1] == "end" and "recompute:1" in names and "bwd:1" in names
    want = [c for n in names[:-1] for c in ("-", f"+{n}")][1:] + ["-"]
    assert calls == want and not phases.open
    calls.clear()
    phases("fwd:1")
    phases.close()  # as the executor does when a step raises
    assert calls == ["+fwd:1", "-"] and not phases.open


@pytest.mark.parametrize("value, msg", [("default", "needs launch.runner 'ray'"), ("always", "mapping of nsys")])
def test_launch_nsight_is_checked_where_it_is_set(value: str, msg: str) -> None:
    from megatrain.launch.config import load_config

    runner = ["launch.runner=inprocess"] if "runner" in msg else []
    with pytest.raises(Exception, match=msg) as info:
        load_config(None, [f"launch.nsight={value}", *runner])
    assert "launch.nsight" in str(info.value)
    cfg = load_config(None, ['launch.nsight={"t": "cuda,nvtx", "o": "executor"}'])
    assert cfg.launch.nsight == {"t": "cuda,nvtx", "o": "executor"}


def test_launch_nsight_without_nsys_is_refused_before_the_executor_starts(monkeypatch) -> None:
    """Only the gpu-executor runs under nsys; a local node without it gets a config error naming the key."""
    import shutil

    from megatrain.launch.config import load_config
    from megatrain.launch.placement import Demand
    from megatrain.launch.runners import RayRunner

    from megatrain.errors import ConfigError

    monkeypatch.setattr(shutil, "which", lambda name: None)
    runner = RayRunner(load_config(None, ["launch.nsight=default"]).launch)
    runner.started_ray = True
    with pytest.raises(ConfigError, match="launch.nsight: nsys"):
        runner.spawn("gpu-executor", object, (), Demand(1, 1))
