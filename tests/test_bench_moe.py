"""bench/run.py's mixture-of-experts parts on the CPU: the load columns, --routing uniform, the Qwen3-30B-A3B preset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import run as bench_run
from bench.table import load_cell, load_stats
from megatrain.flops import active_params
from megatrain.launch.config.tree import load_config
from megatrain.model.arch import arch_from_config

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.hf.hidden_size=64",
    "model.hf.intermediate_size=32",
    "model.hf.num_attention_heads=4",
    "model.hf.num_key_value_heads=4",
    "model.hf.num_experts=8",
    "model.hf.num_experts_per_tok=2",
    "model.hf.vocab_size=256",
    "engine.device=cpu",
]


def test_load_columns_from_steady_metrics() -> None:
    rows = [{"expert_load": [[4, 4, 4, 4], [8, 0, 4, 4]]}, {"expert_load": [[4, 4, 4, 4], [8, 0, 0, 8]]}]
    stats = load_stats(rows)  # layer 1 over both steps: [16, 0, 4, 12], mean 8 -> 2.0; layer 0: 1.0
    assert stats == {"load_max_mean_worst": 2.0, "load_max_mean_median": 1.5}
    assert load_cell(stats) == "2.00; 1.50" and load_cell({"name": "peer"}) == ""
    assert load_stats([{"loss": 1.0}]) is None  # a dense run


def _bench(out: Path, routing: str) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--model", "olmoe-1b-7b", "--layers", "3", "--batch"]
    cmd += ["4", "--seq", "64", "--steps", "4", "--warmup", "1", "--peers", "", "--routing", routing]
    proc = subprocess.run([*cmd, "--out", str(out), "--extra", *TINY], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (out / "results.md").read_text()
    assert "load max/mean (worst; median layer)" in table and f"routing {routing}" in table
    return json.loads((out / "results.json").read_text())[0]


# The whole bench in a process of its own, its run's actors and all (about 2 minutes on 2 loaded cores): the
# evenness itself is test_bench_tokens.py's, in seconds, and the load columns test_load_columns_from_steady_metrics's;
# this checks the bench's plumbing.
@pytest.mark.slow
def test_uniform_routing_gives_near_even_load_through_the_bench(tmp_path: Path) -> None:
    """A tiny OLMoE on the CPU, 4 steps on random token ids (a mixture of experts' default), MegaTrain starting from
    the saved init: its steady steps route near evenly (1.19 worst when written; every layer balanced on the
    run's tokens is tests/test_bench_tokens.py's), and the token file and the init are gone or under OUT."""
    uniform = _bench(tmp_path / "uniform", "uniform")
    assert uniform["load_max_mean_worst"] < 1.5, uniform["load_max_mean_worst"]
    assert "random tokens" in (tmp_path / "uniform" / "results.md").read_text()
    assert not list(tmp_path.glob("*/megatrain-bench-uniform-*"))


def test_uniform_routing_refused_for_a_dense_model(tmp_path: Path) -> None:
    args = bench_run.parse(["--out", str(tmp_path), "--routing", "uniform", "--layers", "1", "--peers", ""])
    try:
        bench_run.run(args)
    except bench_run.Failed as exc:
        assert exc.code == 2 and "no routers" in str(exc)
    else:
        raise AssertionError("--routing uniform ran on a dense model")


def test_qwen3_30b_a3b_preset_parameters(tmp_path: Path) -> None:
    """The whole model (48 layers): 30.53B parameters, 3.35B active by megatrain.flops.active_params."""
    args = bench_run.parse(["--out", str(tmp_path), "--model", "qwen3-30b-a3b", "--layers", "48"])
    args.hf, extra = bench_run.bench_model(args.model, args.layers, args.extra)
    cfg = load_config(None, bench_run.overrides(args, tmp_path, extra))
    arch = arch_from_config(cfg.model)
    total = arch.layout.num_params if hasattr(arch.layout, "num_params") else None
    if total is None:
        total = sum(s.numel for u in arch.layout.units for s in arch.layout.structure_of(u.index).slots)
    assert cfg.model.family == "qwen3_moe"
    assert round(total / 1e9, 2) == 30.53, total
    assert 3.3e9 < active_params(arch) < 3.4e9, active_params(arch)
