"""The bench's model presets (bench/run.py --model: a published model's layer shape, --layers of it) and
its ablations (--ablations: config overrides of the default variant)."""

QWEN7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}
# allenai/OLMoE-1B-7B-0924's shape (16 layers of 64 experts, top-8: 6.9B parameters, 1.3B active), with the
# load-balancing loss on as in its training recipe (HF's output_router_logits).
OLMOE_1B_7B = {
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "vocab_size": 50304,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.01,
    "output_router_logits": True,
}
# openai/gpt-oss-20b's shape (24 layers of 32 experts, top-4, alternating 128-token sliding and full
# attention with sinks: 21B parameters, 3.6B active); its layer types follow from the layer count.
GPT_OSS_20B = {
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.9,
    "output_router_logits": True,
}
# openai/gpt-oss-120b's shape: gpt-oss-20b's layer but 128 experts, 36 layers (117B parameters, 5.1B active)
GPT_OSS_120B = {**GPT_OSS_20B, "num_local_experts": 128}
# Qwen/Qwen3-30B-A3B's shape (48 layers of 128 experts, top-8, no dense layers: 30.5B parameters, 3.3B active),
# its config.json's values (transformers' Qwen3MoeConfig defaults but for max_position_embeddings and
# norm_topk_prob), with the load-balancing loss on at its router_aux_loss_coef.
QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "head_dim": 128,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": True,
}
# --model NAME -> (family, shape, its name in the tables)
QWEN14B = {
    **QWEN7B,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
}
# Qwen/Qwen2.5-72B's layer shape (80 layers: 72.7B parameters): the Qwen2.5 family's widest.
QWEN72B = {
    **QWEN7B,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
MODELS = {
    "qwen2.5-7b": ("qwen2", QWEN7B, "Qwen2.5-7B shape"),
    "qwen2.5-14b": ("qwen2", QWEN14B, "Qwen2.5-14B shape"),
    "qwen2.5-72b": ("qwen2", QWEN72B, "Qwen2.5-72B shape"),
    "olmoe-1b-7b": ("olmoe", OLMOE_1B_7B, "OLMoE-1B-7B shape"),
    "gpt-oss-20b": ("gpt_oss", GPT_OSS_20B, "GPT-OSS-20B shape"),
    "gpt-oss-120b": ("gpt_oss", GPT_OSS_120B, "GPT-OSS-120B shape"),
    "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B, "Qwen3-30B-A3B shape"),
}
ABLATIONS = {
    "no-double-buffering": ["engine.prefetch=0"],
    "no-adam-overlap": ["train.overlap_adam=false"],
    "slabs": ["ipc.staging=slabs"],
    "resident": ["ipc.staging=resident"],
    "no-clip": ["optim.max_grad_norm=0"],
    "cpu-adam": ["engine.gpu_optimizer=0"],  # every unit's update on the host, as before engine.gpu_optimizer
    "no-speculation": ["ipc.spare_slots=0"],  # no update before the global norm, as before ipc.spare_slots
    "no-lean": ["engine.lean_layers=0"],
    "hf-experts": ["engine.moe_experts=hf"],
}
