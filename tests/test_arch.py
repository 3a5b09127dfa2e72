"""megatrain/model/arch.py describes each family without torch: its store layout must be the one build_spec reads off
HF's meta model, its defaults and derived fields HF's resolved config's, and its accepted fields the ones
computed from this transformers version, for every family and the variants each allows (tied or not, head_dim
apart from hidden / heads, biases, MoE layers left dense), so that an upgrade that changes any of them fails
here instead of the plan describing another model than the run builds."""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers

from megatrain.errors import ConfigError
from megatrain.layers.moe import num_experts
from megatrain.model import archfields as arch
from megatrain.model.arch import Arch, accepted_fields, arch_from_config, arch_of_spec
from megatrain.model.spec import (
    FAMILIES,
    ModelConfig,
    build_spec,
    check_on_meta,
    config_class,
    head_dim,
    hf_config_fields,
    meta_model,
    resolve_hf_config,
)

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}
MOE_SMALL = {**SMALL, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80, "num_experts": 6}

# Per family, the variants its config allows, each over the small shape (the defaults alone, with 2 layers,
# come first: HF's own sizes on the meta device).
VARIANTS: dict[str, list[dict]] = {
    "llama": [
        {"tie_word_embeddings": True},
        {"head_dim": 32, "attention_bias": True, "mlp_bias": True},
        {"num_key_value_heads": None, "rms_norm_eps": 1},
    ],
    "qwen2": [{"tie_word_embeddings": True}, {"head_dim": 8}, {"use_sliding_window": True, "max_window_layers": 2}],
    "mistral": [{"tie_word_embeddings": True}, {"head_dim": 32}, {"sliding_window": None}],
    "qwen3": [{"tie_word_embeddings": True}, {"head_dim": 16, "attention_bias": True}, {"head_dim": 32}],
    "mixtral": [{"num_local_experts": 4, "num_experts_per_tok": 1}, {"num_experts": 3, "head_dim": 32}],
    "qwen2_moe": [
        {"mlp_only_layers": [0, 2], "num_experts": 4},
        {"decoder_sparse_step": 2, "qkv_bias": False, "tie_word_embeddings": True},
        {"head_dim": 8, "shared_expert_intermediate_size": 40, "mlp_only_layers": None},
    ],
    "qwen3_moe": [
        {"mlp_only_layers": [1], "decoder_sparse_step": 2, "num_experts": 4},
        {"head_dim": 32, "attention_bias": True, "tie_word_embeddings": True},
        {"num_local_experts": 5, "num_experts_per_tok": 2},
    ],
    "olmoe": [{"attention_bias": True, "num_experts": 4}, {"tie_word_embeddings": True, "num_local_experts": 3}],
    "gpt_oss": [
        {"num_local_experts": 4, "head_dim": 8},
        {"attention_bias": False, "tie_word_embeddings": True, "num_experts": 3},
    ],
}
# Keys HF turns into others (the legacy RoPE names folded into rope_parameters): nothing here reads them
FOLDED = {"rope_parameters", "rope_theta", "rope_scaling"}


def cases() -> list[tuple[str, dict]]:
    out = []
    for family in FAMILIES:
        small = MOE_SMALL if family in arch.MOE_FAMILIES else SMALL
        small = {k: v for k, v in small.items() if k in accepted_fields(family)}
        out += [(family, {"num_hidden_layers": 2}), (family, dict(small))]
        out += [(family, {**small, **variant}) for variant in VARIANTS[family]]
    return out


CASES = cases()
IDS = [f"{family}-{sum(f == family for f, _ in CASES[:i])}" for i, (family, _) in enumerate(CASES)]


def resolved(family: str, hf: dict) -> transformers.PretrainedConfig:
    return resolve_hf_config(ModelConfig(family=family, hf=hf))[1]


@pytest.mark.parametrize(("family", "hf"), CASES, ids=IDS)
def test_the_layout_is_build_specs(family: str, hf: dict) -> None:
    cfg = ModelConfig(family=family, hf=hf)
    for no_decay_1d in (True, False):
        layout = build_spec(cfg, no_decay_1d).layout
        assert arch_from_config(cfg, no_decay_1d=no_decay_1d).layout == layout
        assert arch_from_config(cfg, no_decay_1d=no_decay_1d).layout.digest() == layout.digest()


def _moe_facts(family: str, hf: transformers.PretrainedConfig) -> dict:
    """The MoE facts as HF's meta model has them: which layers route, the experts' and the shared expert's
    widths read off their tensors."""
    model = meta_model(family, hf)
    moe_layers, expert, shared = [], 0, 0
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            moe_layers.append(i)
            down = experts.down_proj
            expert = down.shape[2] if family != "gpt_oss" else down.shape[1]
        if getattr(layer.mlp, "shared_expert", None) is not None:
            shared = layer.mlp.shared_expert.gate_proj.weight.shape[0]
    return {"moe_layers": tuple(moe_layers), "moe_intermediate_size": expert, "shared": shared}


@pytest.mark.parametrize(("family", "hf"), CASES, ids=IDS)
def test_every_arch_field_is_hfs(family: str, hf: dict) -> None:
    conf = resolved(family, hf)
    a = arch_from_config(ModelConfig(family=family, hf=hf))
    facts = _moe_facts(family, conf)
    assert a.family == family
    assert a.hidden_size == conf.hidden_size
    assert a.num_layers == conf.num_hidden_layers == a.layout.num_layers
    assert a.num_attention_heads == conf.num_attention_heads
    assert a.num_key_value_heads == conf.num_key_value_heads
    assert a.head_dim == head_dim(conf)
    assert a.vocab_size == conf.vocab_size
    assert a.tie_word_embeddings == conf.tie_word_embeddings == a.layout.tied
    assert a.num_experts == num_experts(conf)
    assert a.experts_per_token == (conf.num_experts_per_tok if a.num_experts else 0)
    assert a.is_moe == bool(facts["moe_layers"])
    assert a.moe_layers == facts["moe_layers"]
    assert a.moe_intermediate_size == facts["moe_intermediate_size"]
    assert a.shared_expert_intermediate_size == facts["shared"]
    dense = [layer for i, layer in enumerate(meta_model(family, conf).model.layers) if i not in a.moe_layers]
    if dense:  # the dense MLP's width, where a layer has one
        assert a.intermediate_size == dense[0].mlp.gate_proj.weight.shape[0]
    assert a.intermediate_size == (0 if family in ("mixtral", "olmoe", "gpt_oss") else conf.intermediate_size)


@pytest.mark.parametrize(("family", "hf"), CASES, ids=IDS)
def test_every_resolved_field_is_hfs(family: str, hf: dict) -> None:
    """Each value of Arch.fields (defaults, what was set, what the config class derives) is what HF resolves."""
    conf = resolved(family, hf)
    fields = arch_from_config(ModelConfig(family=family, hf=hf)).fields
    assert set(arch.DEFAULTS[family]) <= set(fields)
    for key, value in fields.items():
        if key not in FOLDED:
            assert getattr(conf, key) == value, key
            assert type(getattr(conf, key)) is type(value), key


@pytest.mark.parametrize("family", FAMILIES)
def test_the_defaults_are_the_config_classs(family: str) -> None:
    """The table holds every field the family's config class declares beyond PretrainedConfig's, with its
    default; the aliases are the class's attribute_map."""
    cls = config_class(family)
    base = {f.name for f in dataclasses.fields(transformers.PretrainedConfig)}
    own = {f.name: f for f in dataclasses.fields(cls) if f.name not in base}
    names = {arch.ALIASES.get(family, {}).get(k, k) for k in own}
    assert set(arch.DEFAULTS[family]) == names
    for name, f in own.items():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert arch.DEFAULTS[family][arch.ALIASES.get(family, {}).get(name, name)] == default, name
    assert {k: v for k, v in arch.ALIASES.get(family, {}).items()} == dict(getattr(cls, "attribute_map", {})) or (
        {v: k for k, v in arch.ALIASES.get(family, {}).items()} == dict(getattr(cls, "attribute_map", {}))
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_accepted_fields_are_the_ones_transformers_gives(family: str) -> None:
    assert accepted_fields(family) == hf_config_fields(family)
    assert accepted_fields(family, {"custom_key": 1}) == hf_config_fields(family, {"custom_key": 1})


@pytest.mark.parametrize(("family", "hf"), CASES, ids=IDS)
def test_arch_of_spec_is_arch_from_config(family: str, hf: dict) -> None:
    cfg = ModelConfig(family=family, hf=hf)
    a, b = arch_from_config(cfg), arch_of_spec(build_spec(cfg))
    for field in dataclasses.fields(Arch):
        if field.name != "fields":
            assert getattr(a, field.name) == getattr(b, field.name), field.name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_head_dim_rule_is_hfs_attention(family: str) -> None:
    """PLAIN_HEAD_DIM_ONLY names exactly the families whose attention refuses head_dim != hidden / heads."""
    small = {**SMALL, "head_dim": 32}
    try:
        check_on_meta(ModelConfig(family=family, hf=small))
        refused = False
    except ConfigError:
        refused = True
    assert refused == (family in arch.PLAIN_HEAD_DIM_ONLY)


def test_a_pretrained_config_json_is_read(tmp_path) -> None:
    """config.json's family and fields, with model.hf over them; an alias and a whole-number float."""
    config = {**MOE_SMALL, "model_type": "qwen3_moe", "rms_norm_eps": 1, "architectures": ["Qwen3MoeForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig(family="llama", pretrained=str(tmp_path), hf={"num_hidden_layers": 3})
    a = arch_from_config(cfg)
    assert (a.family, a.num_layers, a.num_experts, a.fields["rms_norm_eps"]) == ("qwen3_moe", 3, 6, 1.0)
    assert a.layout == build_spec(cfg).layout


@pytest.mark.parametrize("value", [0, -1, 2.5, "64"])
def test_a_shape_field_that_is_no_positive_integer_is_named(value) -> None:
    with pytest.raises(ConfigError, match="model.hf.hidden_size"):
        arch_from_config(ModelConfig(family="llama", hf={**SMALL, "hidden_size": value}))
