"""`megatrain-launch plan`: the memory plan against measured peaks, its verdict, and the refusals it predicts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatrain.errors import ResourceError
from megatrain.flops import active_params, expert_params
from megatrain.launch.cli import plan_view
from megatrain.launch.cli.main import main
from megatrain.launch.config import memplan
from megatrain.launch.config.tree import load_config
from megatrain.layers.moe import is_expert_slot
from megatrain.memory import autosize
from megatrain.model.spec import build_spec
from megatrain.step.engine import EngineConfig, resolve_engine
from tests.harness import MOE_FAMILIES, QWEN7B, TINY, tiny_config_dict
from tests.model_fixtures import tiny_hf

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]

HOST_ADAM = "engine.gpu_optimizer=0"
# Measured with the product's defaults (clipping on, the gradients in the resident copy), 2026-11-25
# (BENCHMARKS.md): (layers, batch, seq, extra overrides) -> the last block the run chose, the PSS of all its
# processes after the last step (GiB), the GPU's peak allocation (GiB), and the GPU memory free after the
# CUDA context (GiB): one H200 (139.3) and one H100 (78.66).
H200, H100 = 139.3, 78.66
MEASURED = [
    ((28, 16, 4096, []), 13, 101.94, 125.8, H200),
    ((28, 16, 4096, []), 6, 101.99, 68.11, H100),
    ((8, 16, 4096, []), 8, 41.20, 122.98, H200),
    # measured with every update on the host, before engine.gpu_optimizer (its auto holds units here now)
    ((8, 4, 4096, [HOST_ADAM]), 8, 41.09, 51.65, H200),
    ((8, 158, 1024, [HOST_ADAM]), 8, 41.23, 103.4, H200),
]
# With engine.gpu_optimizer auto, on one H200 (2026-11-28, BENCHMARKS.md): (shape) -> the units held, the
# GPU's peak allocation (GiB). The plan counts each held parameter's weights and gradient beside the step's own
# terms, which for units the step keeps anyway (its last block) count them twice: an upper bound.
HELD = [((8, 4, 4096, []), 10, 83.37), ((8, 158, 1024, []), 4, 116.0)]
# Earlier, without clipping, on an H200 (2026-11-23/24): K 2 and every activation checkpoint offloaded then
# (the settings are given here); the 34-layer run had no room for the resident copy.
NO_CLIP = "optim.max_grad_norm=0"
PLAIN = "engine.lean_layers=0"  # measured before lean layers existed
THEN = ["engine.checkpoint_interval=2", "engine.offload_checkpoints=true", HOST_ADAM]
MEASURED += [
    (
        (28, 16, 4096, [PLAIN, NO_CLIP, *THEN, "engine.chunk_sequences=2", "engine.last_block_layers=28"]),
        28,
        105.46,
        106.7,
        H200,
    ),
    ((34, 16, 4096, [PLAIN, NO_CLIP, *THEN, "ipc.staging=slabs"]), 7, 115.27, 124.2, H200),
]


def qwen_cfg(layers: int, batch: int, seq: int, extra: list[str], *more: str):
    hf = json.dumps({**QWEN7B, "num_hidden_layers": layers})
    return load_config(
        None,
        [
            "model.family=qwen2",
            f"model.hf={hf}",
            f"data.seq_len={seq}",
            f"data.batch_size={batch}",
            "ipc.staging=resident",
            *extra,
            *more,
        ],
    )


@pytest.mark.parametrize("shape,last,host_gib,gpu_gib,free", MEASURED, ids=lambda v: str(v))
def test_plan_is_within_the_measured_peaks(shape, last, host_gib, gpu_gib, free) -> None:
    """Within 10 % of every measured peak; the defaults' host part within 2 % (it is nearly all the store)."""
    plan = memplan.make_plan(qwen_cfg(*shape), int(free * GIB), cuda=True)
    assert f"last_block_layers {last}," in plan.sizes  # the sizes the measured run chose
    assert plan.run_pss() / GIB == pytest.approx(host_gib, rel=0.02 if not shape[3] else 0.10)
    assert sum(plan.gpu.values()) / GIB == pytest.approx(gpu_gib, rel=0.10)


@pytest.mark.parametrize("shape,units,gpu_gib", HELD, ids=lambda v: str(v))
def test_a_plan_holding_the_optimizer_on_the_gpu_bounds_the_measured_peak(shape, units, gpu_gib) -> None:
    """The units the run chose, and a GPU peak above the measured one by at most 15 %."""
    plan = memplan.make_plan(qwen_cfg(*shape), int(H200 * GIB), cuda=True)
    assert plan.memory.gpu.gpu_units == units
    assert gpu_gib <= sum(plan.gpu.values()) / GIB <= 1.15 * gpu_gib


def test_a_plan_that_does_not_fit_says_so_and_what_needs_less(capsys, tmp_path) -> None:
    """The 8-layer 7B shape at 16x4096 on an H200 and a 48 GiB host with 40 GiB available: every layer in the
    last block (2 of them lean), so no activation checkpoints; clipping with the gradients in the resident
    copy: 12 bytes per parameter of fp32 planes, the bf16 copy and the processes. The GPU part fits, the host
    part does not; the settings offered are those that, re-planned, need less, by what they save."""
    overrides = ["model.family=qwen2", f"model.hf={json.dumps({**QWEN7B, 'num_hidden_layers': 8})}"]
    cfg = load_config(None, [*overrides, "data.seq_len=4096", "data.batch_size=16"])
    gpu = int(139.3 * GIB)
    host = memplan.Host(ram=40 * GIB, total=48 * GIB, shm=64 * GIB, threshold=0.98)
    plan = memplan.make_plan(cfg, gpu, cuda=True, machine=host)
    assert "lean_layers 2," in plan.sizes and "activation checkpoints: none" in plan.sizes
    assert sum(plan.host.values()) / GIB == pytest.approx(43.36, abs=0.005)
    assert plan.run_pss() / GIB == pytest.approx(41.33, abs=0.005)
    assert plan.run_pss() / plan.num_params == pytest.approx(15.0, abs=0.05)
    assert plan.host["shm: resident"] > 0 and "shm: grads" not in plan.host  # the gradients go in the copy
    assert host.limit == pytest.approx(48 * GIB * 0.98 - 8 * GIB)  # Ray's monitor keeps 2 % of the RAM free
    assert not plan.host_fits() and plan.gpu_fits() and not plan.fits()
    assert sum(plan.gpu.values()) / GIB == pytest.approx(125.09, abs=0.005)

    tips = plan_view.suggestions(plan, cfg)
    offered = [tip.split(": ", 1)[0] for tip in tips if not tip.startswith("none")]
    # no clipping alone saves nothing with the gradients in the copy, and slabs alone need a gradient plane
    assert offered == [f"optim.max_grad_norm=0 ipc.staging=slabs ipc.slab_params={plan_view._quarter_layer(cfg)}"]
    lever = load_config(None, [*overrides, "data.seq_len=4096", "data.batch_size=16", *offered[0].split()])
    saved = sum(plan.host.values()) - sum(memplan.make_plan(lever, gpu, cuda=True, machine=host).host.values())
    assert saved / GIB == pytest.approx(3.53, abs=0.005) and f"(-{saved / GIB:.2f} GiB of host RAM)" in tips[0]
    # none fits this host: the host RAM the last tip names is the least that holds the leanest of them
    ram = int(re.search(r"--host-gib (\d+) plans for one", tips[-1]).group(1))
    assert memplan.make_plan(lever, gpu, cuda=True, machine=memplan.this_host(lever, ram)).host_fits()
    assert not memplan.make_plan(lever, gpu, cuda=True, machine=memplan.this_host(lever, ram - 1)).host_fits()

    # another machine (--host-gib, Ray's threshold taking its share): the verdict and the exit code
    path = tmp_path / "c.yaml"
    path.write_text(
        f"model: {{family: qwen2, hf: {json.dumps({**QWEN7B, 'num_hidden_layers': 8})}}}\n"
        "data: {seq_len: 4096, batch_size: 16}\n"
    )
    assert main(["plan", str(path), "--gpu-gib", "139.3", "--host-gib", "44"]) == 1
    assert "verdict: does not fit" in capsys.readouterr().out
    assert main(["plan", str(path), "--gpu-gib", "139.3", "--host-gib", "45"]) == 0
    assert "verdict: fits" in capsys.readouterr().out


def test_pinned_checkpoints_leave_headroom_below_the_hosts_limit() -> None:
    """The 7.6B at 512K on a 125 GiB host: the pinned checkpoints the plan adds stop a headroom below the
    limit Ray's monitor sets (one more would take the plan within half a GiB of the kill line); the rest
    stay on the GPU, which still fits."""
    cfg = qwen_cfg(28, 1, 524288, ["engine.device=cuda", "ipc.staging=auto", "model.hf.max_position_embeddings=524288"])
    host = memplan.Host(ram=125 * GIB, total=125 * GIB, shm=125 * GIB, threshold=0.98)
    plan = memplan.make_plan(cfg, int(139.3 * GIB), cuda=True, machine=host)
    each = 524288 * 3584 * 2
    pinned = plan.host["executor: pinned activation checkpoints"]
    total = sum(plan.host.values())
    assert pinned > 0 and plan.gpu_fits() and plan.host_fits(), plan.sizes
    assert host.limit - total >= 2 * GIB  # 2 % of 122.5 GiB
    assert total + each > host.limit * (1 - memplan.CHECKPOINT_HEADROOM_FRACTION)  # as many as that allows


def test_a_gpu_too_small_for_one_sequence_is_refused_by_the_auto_sizes(capsys, tmp_path) -> None:
    cfg = qwen_cfg(8, 16, 4096, [])
    spec = build_spec(cfg.model)
    engine = resolve_engine(EngineConfig(), cuda=True)
    with pytest.raises(ResourceError, match=r"cannot hold one sequence of 4096 tokens.*6.0 GiB free"):
        autosize.choose(spec, engine, 16, 4096, 6 * GIB, clip=True)
    sizes, _ = autosize.choose(spec, engine, 16, 4096, 20 * GIB, clip=True)  # a chunk of the sequences fits
    assert sizes.chunk_sequences >= 1
    plan = memplan.make_plan(cfg, 6 * GIB, cuda=True)
    assert not plan.gpu_fits() and "cannot hold one sequence" in plan.gpu_error


def test_plan_on_the_cpu_device_has_no_gpu_part(capsys) -> None:
    cfg = str(ROOT / "examples" / "default.yaml")
    assert main(["plan", cfg, "engine.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "engine on cpu" in out and "GPU:" not in out and "verdict: fits" in out
    if not torch.cuda.is_available():
        assert main(["plan", cfg, "engine.device=cuda"]) == 2
        assert "give --gpu-gib N" in capsys.readouterr().err


def _moe_cfg(family: str, hf: dict):
    return load_config(None, [f"model.family={family}", f"model.hf={json.dumps(hf)}", "engine.device=cpu"])


def _m(n: float) -> str:
    return f"{n / 1e6:.2f}M"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_plan_of_a_mixture_of_experts_counts_total_active_and_expert_parameters(family: str) -> None:
    """Against HF's own model of the same config, counted by module: the routed experts are each MoE
    layer's `mlp.experts`; everything else (attention, routers, Qwen2-MoE's shared expert and its gate, the
    dense layer) every token runs, and a token runs top-k of E of each routed expert tensor."""
    hf = tiny_config_dict(family, tied=False)
    model = tiny_hf(family, tied=False)
    total = sum(p.numel() for p in model.parameters())
    moe_mlps = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    routed = sum(p.numel() for mlp in moe_mlps for p in mlp.experts.parameters())
    k, e = hf["num_experts_per_tok"], hf.get("num_local_experts") or hf["num_experts"]
    active = int(total - routed + routed * k / e)
    assert 0 < routed < total and active < total

    plan = memplan.make_plan(_moe_cfg(family, hf), None, cuda=False)
    assert (plan.num_params, plan.active_params, plan.expert_params) == (total, active, routed)
    shared = ", plus a shared expert" if family == "qwen2_moe" else ""
    assert plan.title.startswith(
        f"{family}, 3 layers, {_m(total)} params ({_m(active)} active per token; "
        f"experts {_m(routed)}: {e} per layer, top-{k}{shared}), "
    ), plan.title


def test_a_shared_expert_is_always_active() -> None:
    """Qwen2-MoE's shared expert (and its gate) run for every token: counted whole in the active
    parameters, not among the experts; its routed experts count top-k of E."""
    model = tiny_hf("qwen2_moe", tied=False)
    mlp = model.model.layers[0].mlp
    shared = sum(p.numel() for p in mlp.shared_expert.parameters()) + mlp.shared_expert_gate.weight.numel()
    assert shared > 0
    names = [n for n, _ in model.model.layers[0].named_parameters()]
    assert [n for n in names if is_expert_slot(n)] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert not any(is_expert_slot(n) for n in names if "shared_expert" in n)
    spec = build_spec(_moe_cfg("qwen2_moe", tiny_config_dict("qwen2_moe", tied=False)).model)
    routed = expert_params(spec)
    rest = spec.layout.num_params - routed
    assert active_params(spec) == int(rest + routed * 2 / 4)  # the shared expert is in `rest`, whole
    # had it been counted as routed, the active count would be less by its share of the unused experts
    assert active_params(spec) - int(rest - shared + (routed + shared) * 2 / 4) == shared // 2


def test_plan_of_olmoe_at_full_size() -> None:
    """OLMoE-1B-7B's shape: 6.92B parameters, 1.28B of them active per token."""
    hf = {
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "vocab_size": 50304,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 4096,
    }
    plan = memplan.make_plan(_moe_cfg("olmoe", hf), None, cuda=False)
    assert plan.title.startswith(
        "olmoe, 16 layers, 6.92B params (1.28B active per token; experts 6.44B: 64 per layer, top-8), "
    ), plan.title


def test_plan_of_a_dense_model_keeps_its_line() -> None:
    cfg = load_config(None, [f"model.hf={json.dumps({**TINY, 'num_hidden_layers': 2})}", "engine.device=cpu"])
    plan = memplan.make_plan(cfg, None, cuda=False)
    spec = build_spec(cfg.model)
    assert plan.title.startswith(f"llama, 2 layers, {_m(spec.layout.num_params)} params, ")
    assert plan.active_params == plan.num_params == spec.layout.num_params and plan.expert_params == 0
