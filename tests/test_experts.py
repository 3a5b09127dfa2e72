"""Our expert path (megatrain/layers/experts.py) against transformers' eager experts on the same MoE block, weights and
inputs, CPU fp32: the output and the gradient of every parameter and of the input, per family."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from megatrain.config.model import ModelConfig
from megatrain.layers import experts
from megatrain.layers.experts import EXPERTS
from megatrain.memory.layer import (
    OUR_EXPERTS,
    experts_kept_bytes,
    experts_rerun,
    lean_layer_bytes,
    mlp_width,
    our_layer_bytes,
)
from megatrain.model.arch import Arch, arch_from_config, arch_of_spec
from megatrain.model.spec import ATTENTION, family_classes, resolve_hf_config, with_experts
from megatrain.step import lean
from tests.harness import MOE_FAMILIES
from tests.model_fixtures import EXPERT_HIDDEN as H
from tests.model_fixtures import expert_blocks, spec_for, tiny_hf


def _run(block: torch.nn.Module, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(g)
    return out.detach(), {"input": x.grad, **{n: p.grad for n, p in block.named_parameters()}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _compare(ref, ours, tokens: int = 48, seed: int = 1):
    torch.manual_seed(seed)
    x, g = torch.randn(2, tokens // 2, H), torch.randn(2, tokens // 2, H)
    calls = []
    apply = experts.Experts.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experts.Experts, "apply", lambda *a: calls.append(1) or apply(*a))
        got, got_grads = _run(ours, x, g)
    assert calls, "our path did not run"
    want, want_grads = _run(ref, x, g)
    assert _rel(got, want) <= 1e-6
    assert got_grads.keys() == want_grads.keys()
    for name, w in want_grads.items():
        assert got_grads[name] is not None, name
        if float(w.abs().max()) < 1e-5:  # zero up to rounding (Mixtral's top-1 weights are all 1): both noise
            assert float((got_grads[name] - w).abs().max()) <= 1e-6, name
        else:
            assert _rel(got_grads[name], w) <= 1e-6, name
    return x, got, got_grads


def _used(block, x: torch.Tensor) -> torch.Tensor:
    """Routed rows per expert."""
    router = block.gate if hasattr(block, "gate") else block.router
    with torch.no_grad():
        out = router(x.view(-1, H))
    idx = out[-1] if isinstance(out, tuple) else out
    return torch.bincount(idx.flatten(), minlength=block.experts.gate_up_proj.shape[0])


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 2])
def test_matches_hf_eager(family: str, k: int) -> None:
    _compare(*expert_blocks(family, k=k))


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("norm", [False, True])
def test_norm_topk_prob(family: str, norm: bool) -> None:
    _compare(*expert_blocks(family, norm_topk_prob=norm))


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_with_no_rows(family: str) -> None:
    """Four tokens top-1 over eight experts: at least four get no rows (zero gradients, no rows computed)."""
    ref, ours = expert_blocks(family, k=1)
    x, _, grads = _compare(ref, ours, tokens=4)
    used = _used(ours, x.detach())
    assert (used == 0).sum() >= 4
    empty = used == 0
    assert torch.all(grads["experts.down_proj"][empty] == 0)
    assert torch.all(grads["experts.gate_up_proj"][empty] == 0)


def test_gpt_oss_clamps_active() -> None:
    """Weights large enough that the gate's upper clamp and both of up's clamps cut: their gradients included."""
    ref, ours = expert_blocks("gpt_oss", std=0.6, bias_std=2.0)
    x, _, _ = _compare(ref, ours)
    e = ours.experts
    with torch.no_grad():
        h = x.view(-1, H) @ e.gate_up_proj[0] + e.gate_up_proj_bias[0]
    assert (h[:, ::2] > e.limit).float().mean() > 0.05
    assert (h[:, 1::2].abs() > e.limit).float().mean() > 0.05


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
def test_layouts_grouped_mm_refuses(family: str) -> None:
    """A width whose rows are not a multiple of 16 bytes (30 fp32) runs the per-expert loop: same results."""
    ref, ours = expert_blocks(family, width=30)
    assert not experts._grouped(torch.zeros(4, 30), torch.zeros(2, 30, 8))
    _compare(ref, ours)


def test_loop_matches_grouped(monkeypatch) -> None:
    """The per-expert loop and grouped_mm agree (a layout grouped_mm takes, forced through the loop)."""
    _, ours = expert_blocks("qwen3_moe")
    torch.manual_seed(1)
    x, g = torch.randn(2, 24, H), torch.randn(2, 24, H)
    out, grads = _run(ours, x, g)
    monkeypatch.setattr(experts, "_grouped", lambda a, b: False)
    loop_out, loop_grads = _run(ours, x, g)
    assert _rel(loop_out, out) <= 1e-6
    for name, w in grads.items():
        assert _rel(loop_grads[name], w) <= 1e-6, name


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_deterministic(family: str) -> None:
    _, ours = expert_blocks(family)
    torch.manual_seed(1)
    x, g = torch.randn(2, 24, H), torch.randn(2, 24, H)
    a, ga = _run(ours, x, g)
    b, gb = _run(ours, x, g)
    assert torch.equal(a, b)
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_memory_plan_counts_what_our_path_keeps(family: str) -> None:
    """experts_kept_bytes = the bytes autograd keeps for our Function in one MoE layer of a tiny model (its own
    saved tensors: not the layer's input, kept by the router too, nor the weights), 2x256 tokens in fp32."""
    model = tiny_hf(family, tied=False, layers=1)
    spec = spec_for(model, family)
    layer = model.model.layers[0]
    for m in layer.modules():
        if hasattr(m, "config"):
            m.config = with_experts(m.config, OUR_EXPERTS)
    hidden = spec.hf_config.hidden_size
    x = torch.randn(2, 256, hidden, requires_grad=True)
    pos_ids = torch.arange(256).unsqueeze(0)
    pe = model.model.rotary_emb(x, pos_ids)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept: dict[int, int] = {}
    inputs: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in inputs:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    apply = experts.Experts.apply

    def counted(x_, *args):
        inputs.add(x_.untyped_storage().data_ptr())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return apply(x_, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experts.Experts, "apply", counted)
        layer(x, position_embeddings=pe, position_ids=pos_ids, attention_mask=None)
    arch = arch_of_spec(spec)
    assert inputs, "our path did not run"
    assert OUR_EXPERTS == EXPERTS
    assert sum(kept.values()) == experts_kept_bytes(arch, 512, 4)
    # and the plan's MLP width on our path is below HF's (which also holds the gathered and scattered rows)
    assert mlp_width(arch, OUR_EXPERTS) < mlp_width(arch)


# Two shapes per family: widths, head dims, GQA ratios and top-k apart (GPT-OSS: a sliding window shorter
# than the sequence, so the layer attends in tiles, and one as long, so it does not)
_LAYER_SHAPES = {
    "olmoe": [
        dict(
            hidden_size=512,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=16,
            num_experts_per_tok=8,
        ),
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ],
    "qwen3_moe": [
        dict(
            hidden_size=512,
            moe_intermediate_size=192,
            head_dim=128,
            num_attention_heads=8,
            num_key_value_heads=1,
            num_experts=32,
            num_experts_per_tok=8,
        ),
        dict(
            hidden_size=256,
            moe_intermediate_size=384,
            head_dim=32,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ],
    "mixtral": [
        dict(
            hidden_size=512,
            intermediate_size=384,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        dict(
            hidden_size=256,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_local_experts=16,
            num_experts_per_tok=4,
        ),
    ],
    "qwen2_moe": [
        dict(
            hidden_size=512,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=512,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_experts=16,
            num_experts_per_tok=4,
        ),
        dict(
            hidden_size=256,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=1024,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ],
    "gpt_oss": [
        dict(
            hidden_size=720,
            intermediate_size=720,
            head_dim=64,
            num_attention_heads=16,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=4,
            sliding_window=128,
        ),
        dict(
            hidden_size=256,
            intermediate_size=384,
            head_dim=32,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=16,
            num_experts_per_tok=2,
            sliding_window=1024,
        ),
    ],
}


def _one_layer(family: str, shape: int, experts: str = OUR_EXPERTS, dtype: torch.dtype = torch.bfloat16):
    """(its Arch, the model, the input x, run(x): the layer's forward) for one decoder layer of _LAYER_SHAPES at
    LAYER_TOKENS tokens, with the engine's attention function, on the `experts` path."""
    cfg = ModelConfig(family=family, hf={**_LAYER_SHAPES[family][shape], "vocab_size": 256, "num_hidden_layers": 1})
    _, hf = resolve_hf_config(cfg)
    hf = with_experts(hf, experts)
    hf._attn_implementation = ATTENTION
    torch.manual_seed(0)
    model = family_classes(family)[1](hf).to(dtype)
    x = torch.randn(1, LAYER_TOKENS, hf.hidden_size, dtype=dtype, requires_grad=True)
    pos = torch.arange(LAYER_TOKENS)[None]
    pe = model.model.rotary_emb(x, pos)

    def run(x_: torch.Tensor) -> torch.Tensor:
        return model.model.layers[0](x_, position_embeddings=pe, attention_mask=None, position_ids=pos)[0]

    return arch_from_config(cfg), model, x, run


LAYER_TOKENS = 512


@pytest.mark.parametrize("shape", [0, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_memory_plan_counts_a_whole_layer_on_our_path(family: str, shape: int) -> None:
    """our_layer_bytes against what autograd saves for one whole decoder layer on our path (bf16, the engine's
    attention function, 512 tokens on the CPU: not the layer's input nor its weights): at least all of it,
    at most 15 % more. GPT-OSS's sliding layer keeps, on the CPU as on CUDA's memory-efficient kernel, each
    query tile's keys and values repeated over the heads and the tile's mask, which the term counts."""
    arch, model, x, run = _one_layer(family, shape)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            kept[s.data_ptr()] = max(kept.get(s.data_ptr(), 0), s.nbytes())
        return t

    calls = []
    apply = experts.Experts.apply
    with pytest.MonkeyPatch.context() as mp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mp.setattr(experts.Experts, "apply", lambda *a: calls.append(1) or apply(*a))
        run(x)
    assert calls, "our path did not run"
    planned = LAYER_TOKENS * our_layer_bytes(arch, 2, LAYER_TOKENS) + 4 * arch.num_experts  # + the groups' ends
    assert 1.0 <= planned / sum(kept.values()) <= 1.15


def _lean_kept(family: str, shape: int, experts: str, dtype: torch.dtype) -> tuple[Arch, int, int]:
    """(its Arch, bytes, weight storages) a lean layer (megatrain/step/lean.py, as the engine calls it) keeps from its
    forward to its backward: the distinct storages of the outputs its selective checkpointing caches and of
    what autograd saves outside it, the layer's input included; any of the layer's weights among them is
    counted apart (a weight a kept tensor references stays alive)."""
    arch, model, x, run = _one_layer(family, shape, experts, dtype)
    save_grouped = not experts_rerun(arch.layout)  # megatrain/step/templates.py's choice
    made, contexts = [], lean._CONTEXTS[save_grouped]
    outer: list[torch.Tensor] = []
    with pytest.MonkeyPatch.context() as mp, torch.autograd.graph.saved_tensors_hooks(outer.append, lambda t: t):
        mp.setitem(lean._CONTEXTS, save_grouped, lambda: made.append(contexts()) or made[-1])
        lean.lean_call(run, x, save_grouped=save_grouped)
    cached = [v for entry in made[0][0].storage.values() for v in pytree.tree_leaves(entry)]
    tensors = [getattr(v, "val", None) for v in cached] + outer
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if torch.is_tensor(t)}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert x.untyped_storage().data_ptr() in storages, "the lean call's input is not kept"
    kept = sum(n for ptr, n in storages.items() if ptr not in weights)
    return arch, kept, len(weights & storages.keys())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts_path", [OUR_EXPERTS, "hf"])
@pytest.mark.parametrize("shape", [0, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_memory_plan_counts_a_lean_layer(family: str, shape: int, experts_path: str, dtype) -> None:
    """lean_layer_bytes (weights apart: none is kept by the layer's tensors, the engine's lean call keeps them as
    its input and the term counts them exactly) against what a lean layer keeps on the CPU: on our path its
    count from the structure, at least all of it, at most 2 % more; on HF's its GEMMs' widths, at least all of
    it, at most 25 % more."""
    arch, kept, weights = _lean_kept(family, shape, experts_path, dtype)
    size = torch.finfo(dtype).bits // 8
    planned = lean_layer_bytes(arch, LAYER_TOKENS, size, 0, experts_path)
    assert weights == 0
    assert 0.999 <= planned / kept <= (1.02 if experts_path == OUR_EXPERTS else 1.25), planned / kept


def test_a_dense_lean_layer_is_counted_as_before() -> None:
    """The expert path changes nothing for a dense model: Llama-2-7B's and a Qwen3 shape's lean layer at 16x4096
    tokens in bf16 (1000 weights), their bytes pinned on either path."""
    shapes = {
        "llama": (dict(hidden_size=4096, intermediate_size=11008), 6652168144),
        "qwen3": (
            dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
            3766486992,
        ),
    }
    for family, (hf, pinned) in shapes.items():
        arch = arch_from_config(ModelConfig(family=family, hf={**hf, "num_hidden_layers": 2}))
        for path in (OUR_EXPERTS, "hf"):
            assert lean_layer_bytes(arch, 65536, 2, 1000, path) == pinned, (family, path)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_our_path_does_not_run_is_refused_before_anything_starts(family: str) -> None:
    """A SwiGLU family configured with another activation: our path (the default) stops at the config check,
    naming engine.moe_experts, not in the first step; HF's path takes it."""
    import json

    from megatrain.errors import ConfigError
    from megatrain.launch.config.tree import load_config
    from tests.harness import tiny_config_dict

    hf = json.dumps({**tiny_config_dict(family, False), "hidden_act": "gelu"})
    model = [f"model.family={family}", f"model.hf={hf}", "data.seq_len=32", "data.batch_size=2"]
    with pytest.raises(ConfigError, match=r"engine\.moe_experts: megatrain runs SwiGLU experts .*'gelu'"):
        load_config(None, model)
    assert load_config(None, [*model, "engine.moe_experts=hf"]).engine.moe_experts == "hf"
    assert load_config(None, [*model[:1], f"model.hf={json.dumps(tiny_config_dict(family, False))}", *model[2:]])
