"""The model section of the config tree and the families it names. Free of torch and transformers, so the
config tree loads without them; megatrain/model/spec.py, which builds the families' models, imports them from
here."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from megatrain.config.base import opt

# Class names, resolved on use: the modeling code is imported only by the processes that build a
# model (store owner, executor), not by the packers, accumulators and Adam updater (~90 MB less RSS
# each on the 2-core dev machine; on the H200 their PSS barely moved, see BENCHMARKS.md).
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # dense Qwen3: q/k norms in attention, sliding windows as qwen2
    # Mixture of experts (megatrain/layers/moe.py): routed experts stored as HF's 3D tensors, one per projection.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),  # a shared expert with its sigmoid gate
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),  # attention sinks, alternating sliding windows, biases
}


@dataclass
class ModelConfig:
    family: str = opt(
        "llama",
        "Model family: llama, qwen2, qwen3, mistral (dense); mixtral, qwen2_moe, qwen3_moe, olmoe, gpt_oss "
        "(mixture of experts). Taken from config.json with `pretrained`.",
    )
    pretrained: str | None = opt(
        None, "Local directory written by save_pretrained (config.json + safetensors) to start from; never a hub name."
    )
    hf: dict = opt(
        {},
        "HF config fields (hidden_size, num_hidden_layers, vocab_size, head_dim, tie_word_embeddings, ...) "
        "set over the family's defaults or the pretrained config: the fields of the family's HF config class "
        "and the attributes its modeling code reads (docs/models.md); any other key is an error.",
    )
    init_seed: int = opt(0, "Seed of the fresh initialization (HF's init scheme, drawn unit by unit).")

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            close = difflib.get_close_matches(str(self.family), sorted(FAMILIES), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ValueError(f"model.family '{self.family}' is not one of {sorted(FAMILIES)}{hint}")
