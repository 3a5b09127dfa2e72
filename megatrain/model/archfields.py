"""Each model family's HF config fields as this transformers version declares them: the defaults, the other
names a field goes by, the fields every family accepts, and which families route through experts.
megatrain/model/arch.py derives a model's tensors from them without importing transformers; tests/test_arch.py
compares every table with the installed transformers, so an upgrade that changes one fails there.
"""

from __future__ import annotations

from typing import Any

# Every family's config accepts these without declaring them itself: PretrainedConfig's own fields and the
# legacy RoPE names it folds into rope_parameters (transformers 5).
COMMON_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "chunk_size_feed_forward",
        "dtype",
        "eos_token_id",
        "head_dim",
        "hidden_act",
        "hidden_size",
        "id2label",
        "initializer_range",
        "intermediate_size",
        "is_encoder_decoder",
        "label2id",
        "max_position_embeddings",
        "model_type",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
        "output_attentions",
        "output_hidden_states",
        "pad_token_id",
        "partial_rotary_factor",
        "problem_type",
        "return_dict",
        "rms_norm_eps",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "rope_type",
        "tie_word_embeddings",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "vocab_size",
    }
)

_BASE = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "attention_dropout": 0.0,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
_QWEN = {"vocab_size": 151936, "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096}
_ROUTER = {"output_router_logits": False, "router_aux_loss_coef": 0.001}
# Mistral-7B's shape: MistralConfig's and MixtralConfig's defaults share it
_MISTRAL = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# The fields each family's HF config class declares beyond PretrainedConfig's, with their defaults (the
# class's own, before its __post_init__ derives what it derives: see _derive).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_BASE,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pretraining_tp": 1,
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": None,
    },
    "qwen2": {
        **_BASE,
        **_QWEN,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_window_layers": 28,
        "layer_types": None,
    },
    "mistral": {
        **_BASE,
        **_MISTRAL,
        "sliding_window": 4096,
    },
    "qwen3": {
        **_BASE,
        **_QWEN,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "attention_bias": False,
        "max_window_layers": 28,
        "layer_types": None,
    },
    "mixtral": {
        **_BASE,
        **_ROUTER,
        **_MISTRAL,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "router_jitter_noise": 0.0,
    },
    "qwen2_moe": {
        **_BASE,
        **_QWEN,
        **_ROUTER,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_window_layers": 28,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "norm_topk_prob": False,
        "mlp_only_layers": None,
        "qkv_bias": True,
        "layer_types": None,
    },
    "qwen3_moe": {
        **_BASE,
        **_QWEN,
        **_ROUTER,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_local_experts": 128,
        "norm_topk_prob": False,
        "mlp_only_layers": None,
    },
    "olmoe": {
        **_BASE,
        **_ROUTER,
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": None,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "pad_token_id": 1,
        "eos_token_id": 50279,
        "attention_bias": False,
        "clip_qkv": None,
        "num_experts_per_tok": 8,
        "num_experts": 64,
        "router_aux_loss_coef": 0.01,
        "norm_topk_prob": False,
    },
    "gpt_oss": {
        **_BASE,
        **_ROUTER,
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "layer_types": None,
        "attention_bias": True,
    },
}

# Another name HF's config takes for a field (its attribute_map): model.hf may use either; `fields` holds the
# field under the name HF's to_dict writes.
ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "gpt_oss": {"num_experts": "num_local_experts"},
    "olmoe": {"num_local_experts": "num_experts"},
}
ALIAS_DECLARED = frozenset({"qwen3_moe"})  # families whose config class declares the alias's name
# Attributes a family's modeling code reads that its config class does not declare (OLMoE's sliding_window)
EXTRA_READS: dict[str, frozenset[str]] = {"olmoe": frozenset({"sliding_window"})}

MOE_FAMILIES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"})
# MoE families whose every layer routes through experts of width intermediate_size (no dense MLP at all)
ALL_EXPERTS = frozenset({"mixtral", "olmoe", "gpt_oss"})
# HF's OLMoE norms q and k over hidden_size, so its attention runs only where head_dim is hidden / heads
PLAIN_HEAD_DIM_ONLY = frozenset({"olmoe"})
