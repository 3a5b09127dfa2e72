"""A model described without torch or transformers: what the memory and time plans and the config checks need.

Each family's parameter tensors (names, shapes, which take weight decay, the units they stream in) are derived
here from the config fields, with the family's defaults for every field of its HF config class, so that
`megatrain-launch plan` and the config checks import no torch, numba or transformers modeling code. The store
layout this gives is the one megatrain/model/spec.py's build_spec reads off the meta model; tests/test_arch.py
compares the two, the defaults and the accepted fields with this transformers version's for every family, so
an upgrade that changes any of them fails there rather than planning another model than the one run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from megatrain.config.base import Where, key_error
from megatrain.config.model import FAMILIES, ModelConfig
from megatrain.errors import ConfigError
from megatrain.model.archfields import (
    ALIAS_DECLARED,
    ALIASES,
    ALL_EXPERTS,
    COMMON_FIELDS,
    DEFAULTS,
    EXTRA_READS,
    MOE_FAMILIES,
)
from megatrain.model.layout import StoreLayout, build_layout

Tensors = list[tuple[str, tuple[int, ...], bool]]

_SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True, kw_only=True)
class Arch:
    """What the memory and time plans need to know of a model, with no torch."""

    family: str
    layout: StoreLayout  # identical to megatrain.model.spec.build_spec(cfg).layout
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (0 where the family has none)
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int  # 0 for dense families
    experts_per_token: int  # 0 for dense
    moe_intermediate_size: int  # per expert (0 for dense)
    shared_expert_intermediate_size: int  # qwen2_moe's shared expert, else 0
    moe_layers: tuple[int, ...]  # 0-based decoder layers that are MoE
    fields: Mapping[str, Any]  # every resolved HF config value, defaults filled

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.experts_per_token > 0

    @property
    def active_fraction(self) -> float:
        """The share of a routed expert tensor a token uses: top-k of E (1 for a dense model)."""
        return self.experts_per_token / self.num_experts if self.is_moe else 1.0

    @property
    def attention_widths(self) -> tuple[int, int]:
        """(the queries' width, the keys' and the values' width each) of an attention layer, per token."""
        return self.head_dim * self.num_attention_heads, self.head_dim * self.num_key_value_heads


def accepted_fields(family: str, base: Mapping[str, Any] | None = None) -> frozenset[str]:
    """Every key model.hf may set for this family: its config class's fields and aliases, PretrainedConfig's,
    the legacy RoPE names, what its modeling code reads, and whatever the pretrained config.json holds."""
    own = set(DEFAULTS[family]) | set(ALIASES.get(family, {})) | EXTRA_READS.get(family, frozenset())
    return COMMON_FIELDS | own | frozenset(base or {})


def pretrained_config(cfg: ModelConfig) -> tuple[str, dict]:
    """(family, config.json as a dict) of model.pretrained, or (model.family, {}) without one."""
    family, base = cfg.family, {}
    if cfg.pretrained:
        path = Path(cfg.pretrained) / "config.json"
        if not Path(cfg.pretrained).is_dir():
            what = "is not a directory" if Path(cfg.pretrained).exists() else "does not exist"
            raise ConfigError(f"model.pretrained: '{cfg.pretrained}' {what} (expected a save_pretrained directory)")
        if not path.is_file():
            raise ConfigError(
                f"model.pretrained: '{cfg.pretrained}' has no config.json (expected a save_pretrained directory)"
            )
        base = json.loads(path.read_text())
        family = base.get("model_type", family)
        if family not in FAMILIES:
            raise ConfigError(
                f"model.pretrained: model_type '{family}' is not supported; use one of {sorted(FAMILIES)}"
            )
    return family, base


def holds_weights(directory: str | Path) -> bool:
    """Whether a save_pretrained directory holds its weights (model.safetensors or a sharded index), whole
    or not: a directory of config.json alone can be planned, not trained."""
    root = Path(directory)
    return (root / "model.safetensors.index.json").is_file() or (root / "model.safetensors").is_file()


def hf_key_error(cfg: ModelConfig, where: Where | None, key: str, msg: str) -> ConfigError:
    """An error about the HF config field `key`, naming where its value came from: model.hf (the config
    file's line or the override), or model.pretrained's config.json where model.hf does not set it."""
    path = Path(cfg.pretrained or "") / "config.json"
    if key in cfg.hf or not cfg.pretrained or key not in pretrained_config(cfg)[1]:
        return key_error(where, f"model.hf.{key}", msg)
    try:
        lines = Where(str(path), path.read_text(encoding="utf-8"))  # JSON is YAML: the key's line
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        lines = Where(str(path), None)
    return ConfigError(f"{lines(key)}: key '{key}' of model.pretrained's config.json: {msg}")


def drop_mxfp4(merged: dict) -> None:
    """Take a checkpoint's MXFP4 `quantization_config` (GPT-OSS as published) out of the config: its experts
    are dequantized on import into the fp32 masters (megatrain/formats/hfformat.py), so the model trained, checkpointed
    and exported is not quantized, and a config that said it was would send from_pretrained looking for
    packed tensors the export does not write. Other quantizations are not read here: refused by name."""
    quant = merged.pop("quantization_config", None)
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(getattr(method, "value", method)).lower() != "mxfp4":
        raise ConfigError(
            f"model.pretrained: quantization_config with quant_method '{method}' is not supported; "
            "only MXFP4 experts (GPT-OSS) are read, dequantized into the fp32 weights"
        )


def merged_fields(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """(family, model.hf over model.pretrained's config.json), as resolve_hf_config hands them to HF."""
    family, base = pretrained_config(cfg)
    merged = {**base, **cfg.hf}
    merged.pop("architectures", None)
    drop_mxfp4(merged)
    return family, merged


def resolve_fields(family: str, merged: Mapping[str, Any]) -> dict[str, Any]:
    """The family's config with `merged` over its defaults, aliases under HF's names, what its __post_init__
    derives filled in, as HF would resolve it (for the fields shapes and plans read)."""
    out = _over_defaults(family, merged)
    _derive(family, out)
    return out


def _over_defaults(family: str, merged: Mapping[str, Any]) -> dict[str, Any]:
    defaults = DEFAULTS[family]
    aliases = ALIASES.get(family, {})
    out = dict(defaults)
    # HF sets the class's declared fields first and any other name after: where both names of one field
    # are given, the undeclared one's value holds (Qwen3-MoE declares the alias, num_experts)
    later = set(aliases) if family not in ALIAS_DECLARED else set(aliases.values())
    for key, value in sorted(merged.items(), key=lambda kv: kv[0] in later):
        key = aliases.get(key, key)
        if value is None and key not in defaults and key not in COMMON_FIELDS:
            continue  # null for an attribute the class does not declare is its absence (resolve_hf_config)
        if isinstance(defaults.get(key), float) and type(value) is int:
            value = float(value)  # YAML and JSON write 0 for 0.0: HF's strict fields want the float
        out[key] = value
    out["use_cache"] = False  # resolve_hf_config's
    return out


def _derive(family: str, f: dict[str, Any]) -> None:
    """What the family's config class derives in its __post_init__."""
    if f.get("num_key_value_heads") is None:
        f["num_key_value_heads"] = f["num_attention_heads"]
    if family in ("llama", "mistral", "gpt_oss") and f.get("head_dim") is None:
        f["head_dim"] = f["hidden_size"] // f["num_attention_heads"]
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        f["sliding_window"] = f["sliding_window"] if f["use_sliding_window"] else None
    if family == "qwen2_moe":
        f["sliding_window"] = f["sliding_window"] if f["use_sliding_window"] else 0
    if "mlp_only_layers" in f and f["mlp_only_layers"] is None:
        f["mlp_only_layers"] = []
    if "layer_types" in f and f["layer_types"] is None:
        f["layer_types"] = _layer_types(family, f)


def _layer_types(family: str, f: Mapping[str, Any]) -> list[str]:
    n = f["num_hidden_layers"]
    if family == "gpt_oss":
        sliding = [bool((i + 1) % 2) for i in range(n)]
    elif family == "qwen2_moe":
        sliding = [bool((i + 1) % 2) and i < f["max_window_layers"] and f["use_sliding_window"] for i in range(n)]
    else:
        sliding = [f["sliding_window"] is not None and i >= f["max_window_layers"] for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _int_field(cfg: ModelConfig | None, where: Where | None, f: Mapping[str, Any], key: str) -> int:
    value = f.get(key)
    if type(value) is not int or value <= 0:
        msg = f"{value!r}: must be a whole number > 0"
        raise hf_key_error(cfg, where, key, msg) if cfg is not None else ConfigError(f"model.hf.{key}: {msg}")
    return value


def is_expert_slot(name: str) -> bool:
    """A routed expert's tensor (not a shared expert's, which every token runs)."""
    return ".experts." in "." + name


def experts_of(f: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer (0: a dense model), under either of HF's names."""
    return int(f.get("num_local_experts") or f.get("num_experts") or 0)


def moe_layer_indices(family: str, f: Mapping[str, Any]) -> tuple[int, ...]:
    """The decoder layers whose MLP routes through experts (Qwen-MoE's mlp_only_layers and
    decoder_sparse_step leave some dense)."""
    if family not in MOE_FAMILIES or not experts_of(f):
        return ()
    layers = range(f["num_hidden_layers"])
    if family in ALL_EXPERTS:
        return tuple(layers)
    dense = set(f.get("mlp_only_layers") or [])
    step = f.get("decoder_sparse_step", 1)
    return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)


def _arch(family: str, f: Mapping[str, Any], layout: StoreLayout) -> Arch:
    heads = f["num_attention_heads"]
    moe = family in MOE_FAMILIES
    expert_width = f["moe_intermediate_size"] if "moe_intermediate_size" in f else f["intermediate_size"]
    return Arch(
        family=family,
        layout=layout,
        hidden_size=f["hidden_size"],
        num_layers=f["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=f.get("num_key_value_heads") or heads,
        head_dim=f.get("head_dim") or f["hidden_size"] // heads,
        intermediate_size=0 if family in ALL_EXPERTS else f["intermediate_size"],
        vocab_size=f["vocab_size"],
        tie_word_embeddings=bool(f["tie_word_embeddings"]),
        num_experts=experts_of(f) if moe else 0,
        experts_per_token=int(f.get("num_experts_per_tok") or 0) if moe else 0,
        moe_intermediate_size=expert_width if moe else 0,
        shared_expert_intermediate_size=int(f.get("shared_expert_intermediate_size") or 0),
        moe_layers=moe_layer_indices(family, f),
        fields=dict(f),
    )


def arch_from_config(cfg: ModelConfig, where: Where | None = None, no_decay_1d: bool = True) -> Arch:
    """The model of a config (model.pretrained's config.json with model.hf over it), with no torch."""
    family, merged = merged_fields(cfg)
    f = _over_defaults(family, merged)
    for key in _SHAPE_FIELDS:
        _int_field(cfg, where, f, key)
    if f.get("head_dim") is not None:  # null: hidden_size / heads; 0 would read as null below, and is refused
        _int_field(cfg, where, f, "head_dim")
    _derive(family, f)
    return _arch(family, f, layout_of(family, f, no_decay_1d))


class BuiltSpec(Protocol):
    """What arch_of_spec reads of megatrain.model.spec.ModelSpec (named so, not imported: the model imports this)."""

    family: str
    layout: StoreLayout

    @property
    def hf_config(self) -> Any: ...


def arch_of_spec(spec: BuiltSpec) -> Arch:
    """The Arch of an already built ModelSpec (inside a run, where torch is there anyway)."""
    hf = spec.hf_config
    f = {**resolve_fields(spec.family, {}), **hf.to_dict()}
    if getattr(hf, "head_dim", None):  # an attribute the modeling reads though the class does not declare it
        f["head_dim"] = hf.head_dim
    return _arch(spec.family, f, spec.layout)


def layout_of(family: str, f: Mapping[str, Any], no_decay_1d: bool = True) -> StoreLayout:
    """The store layout of the model: the units build_spec reads off the meta model, in its order."""

    def tensors(items: list[tuple[str, tuple[int, ...]]]) -> Tensors:
        return [(name, shape, not (no_decay_1d and len(shape) < 2)) for name, shape in items]

    hidden, vocab = f["hidden_size"], f["vocab_size"]
    tied = bool(f["tie_word_embeddings"])
    moe = set(moe_layer_indices(family, f))
    units = [("embed", "model.embed_tokens.", tensors([("weight", (vocab, hidden))]))]
    for i in range(f["num_hidden_layers"]):
        mlp = _experts(family, f) if i in moe else _dense_mlp(family, f)
        norms = [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
        units.append(("layer", f"model.layers.{i}.", tensors(_attention(family, f) + mlp + norms)))
    head = [("norm.weight", (hidden,))] + ([] if tied else [("lm_head.weight", (vocab, hidden))])
    units.append(("head", "model.", tensors(head)))
    hf_names = {} if tied else {f"{len(units) - 1}:lm_head.weight": "lm_head.weight"}
    return build_layout(units, tied, hf_names)


def _linear(name: str, out: int, inp: int, bias: bool) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{name}.weight", (out, inp))] + ([(f"{name}.bias", (out,))] if bias else [])


def _attention(family: str, f: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """A layer's attention tensors, in the order the family's attention module registers them."""
    hidden, heads = f["hidden_size"], f["num_attention_heads"]
    kv = f.get("num_key_value_heads") or heads
    hd = f.get("head_dim") or hidden // heads
    qkv_bias = {"qwen2": True, "qwen2_moe": f.get("qkv_bias"), "mistral": False, "mixtral": False}
    bias = bool(qkv_bias.get(family, f.get("attention_bias")))
    o_bias = bias and family not in ("qwen2", "qwen2_moe")
    out = [("self_attn.sinks", (heads,))] if family == "gpt_oss" else []
    out += _linear("self_attn.q_proj", heads * hd, hidden, bias)
    out += _linear("self_attn.k_proj", kv * hd, hidden, bias)
    out += _linear("self_attn.v_proj", kv * hd, hidden, bias)
    out += _linear("self_attn.o_proj", hidden, heads * hd, o_bias)
    if family in ("qwen3", "qwen3_moe"):  # q and k normed per head
        out += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
    elif family == "olmoe":  # over the whole width, by hidden_size (why PLAIN_HEAD_DIM_ONLY)
        out += [("self_attn.q_norm.weight", (hidden,)), ("self_attn.k_norm.weight", (hidden // heads * kv,))]
    return out


def _dense_mlp(family: str, f: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    hidden, inner, bias = f["hidden_size"], f["intermediate_size"], bool(f.get("mlp_bias"))
    return (
        _linear("mlp.gate_proj", inner, hidden, bias)
        + _linear("mlp.up_proj", inner, hidden, bias)
        + _linear("mlp.down_proj", hidden, inner, bias)
    )


def _experts(family: str, f: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """A MoE layer's router and experts (HF's 3D expert tensors), in the family's registration order."""
    hidden, e = f["hidden_size"], experts_of(f)
    inner = f.get("moe_intermediate_size") or f["intermediate_size"]
    gate = [("mlp.gate.weight", (e, hidden))]
    experts = [("mlp.experts.gate_up_proj", (e, 2 * inner, hidden)), ("mlp.experts.down_proj", (e, hidden, inner))]
    if family == "gpt_oss":  # transposed expert matrices, with biases; the router has one too
        return [
            ("mlp.router.weight", (e, hidden)),
            ("mlp.router.bias", (e,)),
            ("mlp.experts.gate_up_proj", (e, hidden, 2 * inner)),
            ("mlp.experts.gate_up_proj_bias", (e, 2 * inner)),
            ("mlp.experts.down_proj", (e, inner, hidden)),
            ("mlp.experts.down_proj_bias", (e, hidden)),
        ]
    if family == "qwen3_moe":
        return experts + gate
    if family == "qwen2_moe":
        shared = f["shared_expert_intermediate_size"]
        return (
            gate
            + experts
            + _linear("mlp.shared_expert.gate_proj", shared, hidden, False)
            + _linear("mlp.shared_expert.up_proj", shared, hidden, False)
            + _linear("mlp.shared_expert.down_proj", hidden, shared, False)
            + _linear("mlp.shared_expert_gate", 1, hidden, False)
        )
    return gate + experts
