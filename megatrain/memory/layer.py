"""What one decoder layer keeps for its backward, per token, from the model's shape alone (an Arch): the MLP's
activation width (a mixture of experts' routed width), and a lean layer's bytes (megatrain/lean.py, which
keeps only the GEMM and attention outputs). The memory model of megatrain/memory/autosize.py is built on these."""

from __future__ import annotations

from megatrain.arch import Arch
from megatrain.layout import StoreLayout

# GPT-OSS's clamped GLU (swiglu_limit) keeps about twice a SwiGLU's tensors per routed row for its backward
# (the clamps, the sigmoid gate, the biases added in place): 2.2x, from the saved tensors of its layer on the
# CPU and the peak of a 16x4096 run on an H100
CLAMPED_GLU = 2.2


def mlp_width(arch: Arch) -> float:
    """The MLP's per-token activation width in units of a dense MLP's intermediate size, for the memory
    plan's `8·hidden + 11·intermediate` rule: a routed token runs top-k experts of the expert width, and
    the grouped path also holds the gathered and scattered hidden rows (about 8 hidden-sized copies per
    routed token, counted as 8/11 of a width each); a shared expert runs for every token."""
    f = arch.fields
    dense = float(f["intermediate_size"])
    if not arch.is_moe:
        return dense
    k = arch.experts_per_token
    expert = f.get("moe_intermediate_size") or f["intermediate_size"]
    shared = f.get("shared_expert_intermediate_size") or 0
    expert *= CLAMPED_GLU if f.get("swiglu_limit") is not None else 1.0
    routed = k * expert + k * arch.hidden_size * 8 / 11 + shared
    sparse_every_layer = not f.get("mlp_only_layers") and f.get("decoder_sparse_step", 1) == 1
    return routed if sparse_every_layer else max(routed, dense)


def lean_layer_bytes(arch: Arch, tokens: int, dtype_bytes: int, layer_numel: int) -> int:
    """GPU bytes a lean decoder layer holds from its forward to its backward, for `tokens` tokens.

    Per token: the layer's input and the outputs of o and down (hidden each), of q and attention (heads x
    head_dim each), of k and v (kv heads x head_dim each), of gate and up (intermediate each; a mixture of
    experts' routed width, mlp_width), and the attention's fp32 log-sum-exp (one per head); plus the layer's
    weights in compute dtype, which the last block keeps until its backward."""
    q, kv = arch.attention_widths
    attention = q
    if has_sinks(arch.layout):  # the sinks' virtual key pads the attention's head dim (megatrain/attention.py)
        attention = arch.num_attention_heads * -(-(arch.head_dim + 1) // 8) * 8
    if experts_rerun(arch.layout):
        # the experts' grouped GEMMs run again in the backward: of the MLP half only the router's logits
        # (and a shared expert's GEMM outputs) are kept, not the routed rows
        shared = arch.fields.get("shared_expert_intermediate_size") or 0
        mlp = 2 * arch.hidden_size + arch.num_experts + (arch.hidden_size + 2 * shared if shared else 0)
    else:
        mlp = 3 * arch.hidden_size + 2 * mlp_width(arch)
    per_token = int((mlp + q + attention + 2 * kv) * dtype_bytes)
    return tokens * (per_token + 4 * arch.num_attention_heads) + layer_numel * dtype_bytes


def experts_rerun(layout: StoreLayout) -> bool:
    """Whether a lean layer runs its experts' grouped GEMMs again in the backward: where the experts carry
    biases (GPT-OSS), which HF adds in place into the GEMM's output, so that output cannot be kept."""
    return _has_slot(layout, "experts.gate_up_proj_bias")


def has_sinks(layout: StoreLayout) -> bool:
    """Whether attention has sinks (GPT-OSS)."""
    return _has_slot(layout, "self_attn.sinks")


def _has_slot(layout: StoreLayout, suffix: str) -> bool:
    return any(s.name.endswith(suffix) for st in layout.structures.values() for s in st.slots)
