"""Mixture-of-experts families (megatrain/layers/moe.py): the engine's loss, load-balancing loss and every unit's
gradient equal HF autograd over the whole model, with the aux loss's cross-layer statistics."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from megatrain.data import IGNORE, DataConfig, batch
from megatrain.errors import ConfigError
from megatrain.launch.cli.fidelity import compare
from megatrain.launch.config.tree import load_config
from megatrain.layers.moe import num_experts
from megatrain.model.spec import resolve_hf_config
from tests.harness import MOE_FAMILIES, check, tiny_config, tiny_config_dict
from tests.model_fixtures import (
    ENGINE_CASES,
    check_grads,
    engine_step,
    our_experts_run,
    tiny_hf,
)


def _reference(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    """HF autograd: (language-model loss, aux loss or None where HF leaves it out, every gradient)."""
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    aux = None if out.aux_loss is None else float(out.aux_loss.detach())
    lm = float(out.loss.detach()) - (0.0 if aux is None else model.config.router_aux_loss_coef * aux)
    return lm, aux, {k: p.grad for k, p in model.named_parameters()}


@torch.no_grad()
def _hf_routing(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[list[int]], float]:
    """HF's own record of the routing, whatever output_router_logits says: per MoE layer the top-k
    assignments per expert, counted as load_balancing_loss_func does, and its aux loss (no attention mask:
    every token counts)."""
    out = model(input_ids=ids, output_router_logits=True)
    k, experts = model.config.num_experts_per_tok, num_experts(model.config)
    load = [
        torch.topk(F.softmax(logits.float(), dim=-1), k).indices.flatten().bincount(minlength=experts).tolist()
        for logits in out.router_logits
    ]
    return load, float(out.aux_loss)


@pytest.mark.parametrize("experts", ["hf", "megatrain"])  # engine.moe_experts; HF's reference stays HF's
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_moe_engine_matches_hf_autograd(family: str, case: str, experts: str) -> None:
    """One block counts its routing in the forward with grad; sequence chunks run the last block per
    chunk, which needs every chunk's routing counted before the first chunk's backward."""
    model = tiny_hf(family, tied=False)
    ids, labels = batch(DataConfig(seq_len=24, batch_size=3), 0)
    ref_lm, ref_aux, ref_grads = _reference(model, ids, labels)
    spec, res, sink = engine_step(model, family, case, ids, labels, experts)

    assert abs(float(res.loss) - ref_lm) <= 1e-6 * abs(ref_lm)
    assert abs(float(res.routers.aux_loss()) - ref_aux) <= 1e-6 * abs(ref_aux)
    load = res.routers.load()
    assert all(sum(row) == ids.numel() * 2 for row in load)  # every token routed to top-2
    check_grads(spec, sink, ref_grads)


# Configurations real checkpoints have beyond MOE_TINY's: (family, HF config fields over MOE_TINY's, batch
# size, labels with ignored positions). Each runs the engine cases of distinct code paths below.
VARIANTS = {
    # dense MLP layers among the MoE ones (layer 1 only is sparse), renormalized top-k weights
    "qwen3_moe-sparse-step-2-norm": ("qwen3_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True}, 3, False),
    # Qwen3-30B-A3B's head_dim is not hidden_size / heads
    "qwen3_moe-mlp-only-head-dim": ("qwen3_moe", {"mlp_only_layers": [0], "head_dim": 16}, 3, False),
    "qwen3_moe-window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, 3, False),
    # a shared expert of width 0 is none; every layer sparse
    "qwen2_moe-norm-no-shared": (
        "qwen2_moe",
        {"norm_topk_prob": True, "shared_expert_intermediate_size": 0, "mlp_only_layers": []},
        3,
        False,
    ),
    # layers 0 and 2 slide: Qwen2-MoE's attention keeps its window on the module (megatrain/layers/attention.py)
    "qwen2_moe-window": (
        "qwen2_moe",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
        3,
        False,
    ),
    # HF then adds no aux loss: nor may the engine's gradient; its aux loss and load are still reported
    "mixtral-no-aux": ("mixtral", {"output_router_logits": False}, 3, False),
    "mixtral-coef-0": ("mixtral", {"router_aux_loss_coef": 0.0}, 3, False),
    # top-1: the renormalized weight is 1, only the aux loss reaches the router
    "mixtral-window-top-1": ("mixtral", {"sliding_window": 8, "num_experts_per_tok": 1}, 3, False),
    "mixtral-2-experts-tied": ("mixtral", {"num_local_experts": 2, "tie_word_embeddings": True}, 3, False),
    "olmoe-norm-clip-qkv": ("olmoe", {"norm_topk_prob": True, "clip_qkv": 0.5}, 3, False),
    "gpt_oss-all-full": ("gpt_oss", {"layer_types": ["full_attention"] * 3}, 3, False),
    "gpt_oss-all-sliding": ("gpt_oss", {"layer_types": ["sliding_attention"] * 3}, 3, False),
    "gpt_oss-window-over-sequence": ("gpt_oss", {"sliding_window": 32}, 3, False),
    # without an attention mask HF's aux loss counts every token, labelled or not; so does the engine
    "qwen3_moe-batch-1-ignored": ("qwen3_moe", {}, 1, True),
    "gpt_oss-ignored": ("gpt_oss", {}, 3, True),
}
VARIANT_CASES = ["k1", "k2-last1-chunks2", "tiles", "lean"]


@pytest.mark.parametrize("experts", ["hf", "megatrain"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", VARIANT_CASES)
def test_moe_config_variants_match_hf_autograd(variant: str, case: str, experts: str) -> None:
    """The language-model loss and every unit's gradient equal HF autograd's (its loss with the aux term
    only where HF adds it), and the aux loss and each MoE layer's load equal HF's record of the routing."""
    family, hf, batch_size, ignored = VARIANTS[variant]
    model = tiny_hf(family, tied=False, hf=hf)
    ids, labels = batch(DataConfig(seq_len=24, batch_size=batch_size), 0)
    if ignored:
        labels = labels.clone()
        labels[0, :10] = IGNORE
        labels[-1, 17:] = IGNORE
    ref_lm, ref_aux, ref_grads = _reference(model, ids, labels)
    ref_load, hf_aux = _hf_routing(model, ids)
    assert (ref_aux is None) == (not model.config.output_router_logits)
    spec, res, sink = engine_step(model, family, case, ids, labels, experts)

    assert abs(float(res.loss) - ref_lm) <= 1e-6 * abs(ref_lm)
    assert abs(float(res.routers.aux_loss()) - hf_aux) <= 1e-6 * abs(hf_aux)
    assert res.routers.load() == ref_load
    assert all(sum(row) == ids.numel() * model.config.num_experts_per_tok for row in ref_load)
    check_grads(spec, sink, ref_grads)


def test_moe_config_values_are_read_or_refused_by_name() -> None:
    """A whole number where HF types a float (YAML's `router_aux_loss_coef: 0`) is that float, not HF's
    strict-dataclass error; a value of another type is a ConfigError naming the field. Mixtral's router jitter
    draws noise in each MoE layer's forward; a recomputed layer would draw other noise and route otherwise, so
    a config with it is refused, naming the key."""
    tiny = ["model.family=mixtral", f"model.hf={json.dumps(tiny_config_dict('mixtral', False))}"]
    cfg = load_config(None, [*tiny, "model.hf.router_aux_loss_coef=0", "model.hf.router_jitter_noise=0"])
    hf = resolve_hf_config(cfg.model)[1]
    assert hf.router_aux_loss_coef == 0.0 and isinstance(hf.router_aux_loss_coef, float)
    with pytest.raises(ConfigError, match=r"config key 'model\.hf\.rms_norm_eps': .*expected float"):
        load_config(None, [*tiny, "model.hf.rms_norm_eps=tiny"])
    with pytest.raises(ConfigError, match=r"model\.hf\.router_jitter_noise.*0\.01.*not supported"):
        load_config(None, [*tiny, "model.hf.router_jitter_noise=0.01"])


SYSTEM_CASES = [
    ("mixtral", True, 2, ["engine.chunk_sequences=3"]),  # the last block per chunk: routing counted first
    ("qwen2_moe", False, 1, ["optim.max_grad_norm=0", "ipc.staging=resident"]),
    ("qwen3_moe", False, 3, ["actors.num_packers=2", "actors.num_accumulators=2", "ipc.weight_slabs=3"]),
    ("olmoe", True, 1, ["engine.last_block_layers=3", "engine.lean_layers=2", "optim.max_grad_norm=0"]),
    ("gpt_oss", False, 2, []),
]


@pytest.mark.parametrize("experts", ["hf", "megatrain"])
@pytest.mark.parametrize("family,tied,k,extra", SYSTEM_CASES, ids=[c[0] for c in SYSTEM_CASES])
def test_moe_through_the_actor_system_matches_plain_pytorch(
    tmp_path, family: str, tied: bool, k: int, extra: list[str], experts: str
) -> None:
    """10 steps through every actor (in-process runner) against the HF model + torch.optim.AdamW: the
    language-model loss and the load-balancing loss per step, and the final weights (exported per expert
    as HF writes them, read back), to 1e-5; the metrics carry each layer's expert load."""
    with our_experts_run(experts):
        rep = compare(tiny_config(family, tied, k, tmp_path, extra=[*extra, f"engine.moe_experts={experts}"]), tmp_path)
    check(rep, tied)
    assert len(rep["aux_losses"]) == 10
    for step, (ours, ref) in enumerate(zip(rep["aux_losses"], rep["ref_aux_losses"])):
        assert abs(ours - ref) <= 1e-5 * abs(ref), f"step {step + 1}: aux {ours} vs {ref}"
    load = rep["summary"].metrics[-1]["expert_load"]
    moe_layers = 2 if family == "qwen2_moe" else 3  # its layer 1 is dense (mlp_only_layers)
    assert len(load) == moe_layers and all(sum(row) == 4 * 32 * 2 and len(row) == 4 for row in load)
