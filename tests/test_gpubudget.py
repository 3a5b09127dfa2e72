"""engine.gpu_memory_gib (megatrain/memory/budget.py): the automatic sizes and the plan fit the budget, from 0.5B to
14B dense shapes and a mixture of experts, 4K to 512K tokens; the errors a budget too small gets; the plan's and
the bench's view of it. Pure planning: no GPU (tests/test_gpubudget_cuda.py runs one under a budget)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import auto as bench_auto
from bench import run as bench_run
from megatrain.errors import ConfigError, ResourceError
from megatrain.launch.cli.main import main
from megatrain.launch.config import memplan
from megatrain.launch.config.tree import load_config
from megatrain.memory import autosize
from megatrain.memory import budget as gpubudget
from megatrain.model.spec import ModelConfig, build_spec
from megatrain.step.engine import EngineConfig, resolve_engine

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
LONG = {"max_position_embeddings": 524288, "use_sliding_window": False}
SHAPES = {  # the released models' shapes (Qwen2.5 0.5B-14B; OLMoE-1B-7B: 64 experts, top-8)
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                                   num_key_value_heads=2, num_hidden_layers=24, vocab_size=151936,
                                   tie_word_embeddings=True)),
    "qwen2.5-3b": ("qwen2", dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                                 num_key_value_heads=2, num_hidden_layers=36, vocab_size=151936,
                                 tie_word_embeddings=True)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                 num_key_value_heads=4, num_hidden_layers=28, vocab_size=152064,
                                 tie_word_embeddings=False)),
    "qwen2.5-14b": ("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                                  num_key_value_heads=8, num_hidden_layers=48, vocab_size=152064,
                                  tie_word_embeddings=False)),
    "olmoe-1b-7b": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
                                  num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                                  num_hidden_layers=16, vocab_size=50304, tie_word_embeddings=False)),
}  # fmt: skip
TOKENS = [(16, 4096), (1, 8192), (1, 32768), (1, 131072), (1, 524288)]


def spec_of(name: str):
    family, hf = SHAPES[name]
    extra = LONG if family == "qwen2" else {"max_position_embeddings": 524288}
    return build_spec(ModelConfig(family=family, hf={**hf, **extra}))


def budgeted(gib: float | None = None, **kw) -> EngineConfig:
    return resolve_engine(EngineConfig(gpu_memory_gib=gib, **kw), cuda=True)


def config_file(tmp_path: Path, name: str = "qwen2.5-7b", batch: int = 1, seq: int = 8192) -> Path:
    family, hf = SHAPES[name]
    path = tmp_path / "model.yaml"
    path.write_text(
        json.dumps(
            {
                "model": {"family": family, "hf": {**hf, **LONG}},
                "data": {"seq_len": seq, "batch_size": batch},
                "engine": {"device": "cuda"},
            }
        )
    )
    return path


def test_a_budget_picks_smaller_sizes_than_the_whole_gpu() -> None:
    """7.6B at 16x4096: on an H200's 139.3 GiB the last block takes 13 layers; a 24 GiB budget leaves 23.5 GiB
    beside the context, where it takes fewer layers (more recompute) and the plan's peak stays inside."""
    spec = spec_of("qwen2.5-7b")
    whole, _ = autosize.choose(spec, budgeted(), 16, 4096, int(139.3 * GIB), clip=True)
    room, note = gpubudget.planning_room(budgeted(24), int(139.3 * GIB))
    assert room == 24 * GIB - gpubudget.CONTEXT_BYTES and "0.5 GiB" in note
    small, _ = autosize.choose(spec, budgeted(24), 16, 4096, room, clip=True)
    assert small.last_block_layers < whole.last_block_layers
    assert small.loss_chunk_tokens <= whole.loss_chunk_tokens
    peak = gpubudget.peak_bytes(spec, budgeted(24), 16, 4096, small)
    assert peak <= room < gpubudget.peak_bytes(spec, budgeted(), 16, 4096, whole)


def test_a_budget_above_the_free_memory_plans_for_the_free_memory() -> None:
    room, note = gpubudget.planning_room(budgeted(80), 40 * GIB)
    assert room == 40 * GIB and "planned for the free memory" in note
    assert gpubudget.planning_room(budgeted(), 40 * GIB) == (40 * GIB, "")
    assert gpubudget.planning_room(budgeted("auto"), None) == (None, "")


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("batch,seq", TOKENS, ids=lambda v: str(v))
def test_the_planned_peak_stays_within_the_budget(name: str, batch: int, seq: int) -> None:
    """For budgets of 4 to 128 GiB: wherever the rule finds sizes, the plan's peak is within the budget less the
    context; where it refuses, the budget is below the least the plan computes; that least fits, and a
    sixteenth of a GiB less does not."""
    spec, cfg = spec_of(name), budgeted()
    least = gpubudget.least_room(spec, cfg, batch, seq, clip=True)
    assert least is not None
    assert gpubudget.fitting(spec, cfg, batch, seq, least, clip=True) is not None
    assert gpubudget.fitting(spec, cfg, batch, seq, least - gpubudget.LEAST_STEP, clip=True) is None
    fitted = 0
    for gib in range(4, 129, 4):
        room, _ = gpubudget.planning_room(budgeted(gib), None)
        try:
            sizes, _ = autosize.choose(spec, cfg, batch, seq, room, clip=True)
        except ResourceError:
            assert room < least, f"{gib} GiB refused, though {least / GIB:.2f} GiB fit"
            continue
        peak = gpubudget.peak_bytes(spec, cfg, batch, seq, sizes)
        assert peak <= room, f"{gib} GiB: the plan's peak {peak / GIB:.2f} GiB with {sizes}"
        fitted += 1
    assert fitted


def test_several_executors_plan_each_gpu_for_its_share_within_the_budget(tmp_path: Path) -> None:
    """actors.num_gpus 2: each GPU holds its half of the batch and the gradients queued for the sum, all of it
    within the budget."""
    cfg = load_config(config_file(tmp_path, batch=4, seq=4096), ["actors.num_gpus=2", "engine.gpu_memory_gib=20"])
    plan = memplan.make_plan(cfg, None, True, memplan.this_host(cfg, 512))
    assert "over 2 executors" in plan.title and plan.gpu_budget == 20 * GIB - gpubudget.CONTEXT_BYTES
    assert "fp32 gradients awaiting the executors' sum" in plan.gpu
    assert sum(plan.gpu.values()) <= plan.gpu_budget and plan.gpu_fits()


def test_a_budget_too_small_for_the_model_names_the_least(tmp_path: Path, capsys) -> None:
    spec = spec_of("qwen2.5-7b")
    least = gpubudget.least_room(spec, budgeted(), 1, 8192, clip=True)
    budget = f"{-(-(least + gpubudget.CONTEXT_BYTES) * 10 // GIB) / 10:g} GiB"
    path = config_file(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["engine.gpu_memory_gib=4"])
    assert "engine.gpu_memory_gib=4" in str(err.value) and f"the least the plan computes is {budget}" in str(err.value)
    assert main(["plan", str(path), "engine.gpu_memory_gib=4"]) == 2  # before any plan is made
    err_line = capsys.readouterr().err.strip()
    assert len(err_line.splitlines()) == 1 and "engine.gpu_memory_gib" in err_line
    load_config(path, [f"engine.gpu_memory_gib={budget.split()[0]}"])  # the least itself is accepted


def test_explicit_sizes_that_cannot_fit_the_budget_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(config_file(tmp_path), ["engine.gpu_memory_gib=12", "engine.last_block_layers=20"])
    said = str(err.value)
    assert "config key 'engine.gpu_memory_gib'" in said and "engine.last_block_layers=20" in said
    assert "the least budget with them is" in said and "with every size auto" in said
    load_config(config_file(tmp_path), ["engine.gpu_memory_gib=12", "engine.last_block_layers=2"])


@pytest.mark.parametrize("value", ["0", "-3", "lots", "true", ".inf", "nan"])
def test_a_bad_budget_names_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="engine.gpu_memory_gib"):
        load_config(config_file(tmp_path), [f"engine.gpu_memory_gib={value}"])


def test_an_infinite_budget_is_a_usage_error_of_the_plan(tmp_path: Path, capsys) -> None:
    """.inf passes `> 0`: the plan took it and died converting it to bytes. Now one line naming the key, exit 2."""
    assert main(["plan", str(config_file(tmp_path)), "engine.gpu_memory_gib=.inf", "--gpu-gib", "80"]) == 2
    err = capsys.readouterr().err
    assert "config key 'engine.gpu_memory_gib'" in err and "a finite number of GiB > 0" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the budget is checked where the run would use a GPU")
def test_the_budget_is_not_checked_where_the_run_computes_on_the_cpu(tmp_path: Path) -> None:
    path = config_file(tmp_path)
    load_config(path, ["engine.device=auto", "engine.gpu_memory_gib=1"])
    load_config(path, ["engine.device=cpu", "engine.gpu_memory_gib=1"])


def test_the_plan_shows_the_budget_the_free_memory_and_the_least(tmp_path: Path, capsys) -> None:
    path = config_file(tmp_path)
    host = ["--host-gib", "256"]
    assert main(["plan", str(path), "engine.gpu_memory_gib=24", "--gpu-gib", "46", *host]) == 0
    out = capsys.readouterr().out
    assert "budget: engine.gpu_memory_gib 24 GiB less the CUDA context (0.5 GiB): 23.5 GiB" in out
    assert "the least GPU memory for this run:" in out and "46.00 GiB free" in out
    assert main(["plan", str(path), "engine.gpu_memory_gib=24", "--gpu-gib", "10", *host]) == 0
    assert "is more than the GPU's 10.0 GiB free: planned for the free memory" in capsys.readouterr().out
    if not torch.cuda.is_available():  # no GPU here: the plan is for the budget
        assert main(["plan", str(path), "engine.gpu_memory_gib=24", *host]) == 0
        assert "(planned for engine.gpu_memory_gib)" in capsys.readouterr().out
    assert main(["plan", str(path), "--gpu-gib", "5", *host]) == 1  # no budget, too little free: the least named
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "engine.gpu_memory_gib 6." in out


def test_an_out_of_memory_error_under_the_cap_names_the_budget_and_the_plan() -> None:
    cap = gpubudget.GpuCap(budget=24 * GIB, context=GIB // 2, total=80 * GIB)
    assert cap.room == 24 * GIB - GIB // 2 and "capped at 23.5 GiB of the GPU's 80.0 GiB" in str(cap)
    exc = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")
    line = cap.oom(exc, int(21.25 * GIB))
    assert line.startswith("out of GPU memory under engine.gpu_memory_gib 24 GiB (the allocator's cap 23.5 GiB")
    assert "the plan's peak was 21.2 GiB" in line and "Tried to allocate" not in line and "\n" not in line


def test_the_bench_applies_its_budget_to_megatrain(tmp_path: Path) -> None:
    args = bench_run.parse(["--out", str(tmp_path), "--layers", "2", "--gpu-gib", "20"])
    args.hf, extra = bench_run.bench_model(args.model, args.layers, args.extra)
    cfg = load_config(None, bench_run.overrides(args, tmp_path, extra))
    assert cfg.engine.gpu_memory_gib == 20.0
    no_budget = bench_run.parse(["--out", str(tmp_path), "--layers", "2"])
    no_budget.hf, extra = bench_run.bench_model(no_budget.model, no_budget.layers, no_budget.extra)
    assert load_config(None, bench_run.overrides(no_budget, tmp_path, extra)).engine.gpu_memory_gib is None
    for bad in (["--gpu-gib", "0"], ["--batch", "0"], ["--batch", "many"]):
        with pytest.raises(SystemExit):
            bench_run.parse(["--out", str(tmp_path), *bad])


def test_bench_batch_auto_is_the_most_the_plan_fits_in_the_budget(tmp_path: Path, monkeypatch) -> None:
    """--batch auto on a planned host of 512 GiB: the batch the plan fits in 24 GiB, and one more does not."""
    host = memplan.Host(ram=512 * GIB, total=512 * GIB, shm=512 * GIB, threshold=None)
    monkeypatch.setattr(memplan, "this_host", lambda cfg, host_gib=None: host)
    args = bench_run.parse(["--out", str(tmp_path), "--layers", "4", "--seq", "8192", "--batch", "auto",
                            "--gpu-gib", "24"])  # fmt: skip
    args.hf, args.extra = bench_run.bench_model(args.model, args.layers, args.extra)
    most = bench_run.most_batch(args)
    assert most >= 1

    def fits(b: int) -> bool:  # loaded with the budget: the config's check refuses what the plan does not fit
        args.batch = b
        try:
            cfg = load_config(None, bench_run.overrides(args, tmp_path, args.extra))
        except ConfigError:
            return False
        return memplan.make_plan(cfg, None, True).fits()

    assert fits(most) and not fits(most + 1)


def test_bench_layers_auto_is_the_deepest_model_the_plan_fits_on_the_host(tmp_path: Path, monkeypatch) -> None:
    """--layers auto on a planned host of 64 GiB: the most layers of the 7B shape whose plan fits the host and an
    80 GiB GPU at 1x1024 tokens (the host part bounds it), and one more layer does not fit."""
    host = memplan.Host(ram=64 * GIB, total=64 * GIB, shm=64 * GIB, threshold=None)
    monkeypatch.setattr(memplan, "this_host", lambda cfg, host_gib=None: host)
    args = bench_run.parse(["--out", str(tmp_path), "--layers", "auto", "--batch", "1", "--seq", "1024",
                            "--gpu-gib", "80"])  # fmt: skip
    deepest = bench_auto.most_layers(args)

    def fits(layers: int) -> bool:
        args.hf, extra = bench_run.bench_model(args.model, layers, args.extra)
        cfg = load_config(None, bench_run.overrides(args, tmp_path, extra))
        return memplan.make_plan(cfg, None, True).fits()

    assert 2 <= deepest < 64 and fits(deepest) and not fits(deepest + 1)
    for bad in (["--layers", "0"], ["--layers", "auto", "--batch", "auto"]):
        with pytest.raises(SystemExit):
            bench_run.parse(["--out", str(tmp_path), *bad])


def test_a_bench_budget_too_small_is_one_line_and_exit_2_before_anything_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--out", str(tmp_path / "out"), "--layers", "2"]
        + ["--gpu-gib", "2", "--peers", "plain"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("bench/run.py: error: "), proc.stderr
    assert "config key 'engine.gpu_memory_gib': 2 GiB is too small" in lines[0]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # nothing measured
