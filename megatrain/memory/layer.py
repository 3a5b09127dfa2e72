"""What one decoder layer keeps for its backward, per token, from the model's shape alone (an Arch): the MLP's
activation width (a mixture of experts' routed width), and a lean layer's bytes (megatrain/step/lean.py, which
keeps only the GEMM and attention outputs). The memory model of megatrain/memory/autosize.py is built on these."""

from __future__ import annotations

from megatrain.model.arch import Arch
from megatrain.model.layout import StoreLayout

# GPT-OSS's clamped GLU (swiglu_limit) keeps about twice a SwiGLU's tensors per routed row for its backward
# (the clamps, the sigmoid gate, the biases added in place): 2.2x, from the saved tensors of its layer on the
# CPU and the peak of a 16x4096 run on an H100
CLAMPED_GLU = 2.2


# engine.moe_experts' value for our expert path (megatrain/layers/experts.py, whose name HF knows it by is the same)
OUR_EXPERTS = "megatrain"
# Per routed row, what our path keeps beside h: its place in the sorted order and back (two int64) and its
# routing weight (fp32 at most: Mixtral's router keeps them fp32); biased experts (GPT-OSS) add the row's
# sorted expert id (int64)
_ROUTING_BYTES = 8 + 8 + 4
_BIASED_ROUTING_BYTES = 8


def experts_kept_bytes(arch: Arch, tokens: int, dtype_bytes: int) -> int:
    """Bytes megatrain/layers/experts.py keeps for its backward in one MoE layer (engine.moe_experts=megatrain), for
    `tokens` tokens: each routed row's gate/up output h (2 x the expert width, compute dtype) and its routing;
    per layer the groups' int32 ends. Not the gathered input rows (gathered again) nor the experts' output
    (not needed); the layer's input and the weights are kept by others. 0 for a dense model."""
    if not arch.is_moe:
        return 0
    return tokens * _experts_bytes_per_token(arch, dtype_bytes) + 4 * arch.num_experts


def _experts_bytes_per_token(arch: Arch, dtype_bytes: int) -> int:
    f, k = arch.fields, arch.experts_per_token
    routing = _ROUTING_BYTES + (_BIASED_ROUTING_BYTES if f.get("swiglu_limit") is not None else 0)
    return k * (2 * arch.moe_intermediate_size * dtype_bytes + routing)


def our_layer_bytes(arch: Arch, dtype_bytes: int, tokens: int) -> float:
    """Per token, what one MoE decoder layer on our expert path (engine.moe_experts=megatrain) keeps for its
    backward, counted from the layer's structure (the dense `8·hidden + 11·intermediate` rule's coefficients
    were fitted on dense layers and absorb their norms and attention in the MLP's term, which our path's
    exact expert bytes do not): within 10 % over what autograd saves for one whole layer of each MoE family
    (tests/test_experts.py). `tokens`: the layer's, which bound a sliding window's tiles. Counted: each
    norm's fp32 input and its normalized copy (GPT-OSS's in fp32: its weight multiplies in fp32) and, for
    the two layer norms, their output (the projections' input); q/k norms
    over their widths (OLMoE whole, Qwen3-MoE per head); attention's q, k, v (after rope), output and fp32
    log-sum-exp (GPT-OSS: its sinks' padded head width, a zero query more, and in a sliding window each
    query tile's window of keys and values repeated over the query heads, with the tile's additive mask;
    the layers alternate, so half of them); the rope's cos and sin; the router's fp32 probabilities, top-k
    ids and weights; the routed rows (experts_kept_bytes); a shared expert's GEMM outputs, its activation's
    and its gate's."""
    f, d, hidden = arch.fields, dtype_bytes, arch.hidden_size
    heads, kv_heads, head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    q, kv = arch.attention_widths
    fp32_weights = arch.family == "gpt_oss"  # weight * fp32 normalized, cast after: both fp32 copies kept
    norm = (8 if fp32_weights else 4 + d) * hidden + 4
    kept = 2 * (norm + d * hidden)  # input and post-attention norms, and their outputs
    for name, width in (("q_norm", q), ("k_norm", kv)):
        shape = _slot_shape(arch.layout, f"self_attn.{name}.weight")
        if shape is not None:  # the norm's fp32 input, its normalized copy, one fp32 scale per row normed
            kept += (4 + d) * width + 4 * (width // shape[0])
    kept += 2 * d * head_dim  # rope's cos and sin
    if has_sinks(arch.layout):  # megatrain/layers/attention.py: a virtual key, head widths padded to 8
        padded = -(-(head_dim + 1) // 8) * 8
        full = d * padded * (2 * heads + 2 * kv_heads) + 4 * heads
        window = f.get("sliding_window") or 0
        window = window if window < tokens else 0  # a window as long as the sequence: no tiles (at most)
        # per query tile of `window`: its 2·window keys and values over every query head, its mask
        sliding = d * padded * (2 * heads + 4 * heads) + 2 * window * d + 4 * heads
        types = f.get("layer_types") or []
        share = sum(t == "sliding_attention" for t in types) / len(types) if window and types else 0.0
        kept += share * sliding + (1 - share) * full + d * q  # o_proj's input: the output's unpadded copy
    else:
        kept += d * (2 * q + 2 * kv) + 4 * heads
    k = arch.experts_per_token
    kept += 4 * arch.num_experts + (8 + 4 + 4) * k  # fp32 probabilities, top-k ids, weights (fp32 at most)
    kept += _experts_bytes_per_token(arch, d)
    shared = f.get("shared_expert_intermediate_size") or 0
    if shared:  # gate, up, the activation and the product; its output and its sigmoid gate
        kept += 4 * d * shared + d * hidden + 2 * d
    return kept


def _slot_shape(layout: StoreLayout, suffix: str) -> tuple[int, ...] | None:
    for st in layout.structures.values():
        for s in st.slots:
            if s.name.endswith(suffix):
                return s.shape
    return None


def mlp_width(arch: Arch, experts: str = "hf") -> float:
    """The MLP's per-token activation width in units of a dense MLP's intermediate size, for the memory
    plan's `8·hidden + 11·intermediate` rule: a routed token runs top-k experts of the expert width, and
    HF's grouped path also holds the gathered and scattered hidden rows (about 8 hidden-sized copies per
    routed token, counted as 8/11 of a width each); a shared expert runs for every token. On our path
    (`experts` OUR_EXPERTS) the routed rows keep experts_kept_bytes, counted in half-dtype units (bf16's
    bytes: a little over for fp32's routing)."""
    f = arch.fields
    dense = float(f["intermediate_size"])
    if not arch.is_moe:
        return dense
    k = arch.experts_per_token
    expert = f.get("moe_intermediate_size") or f["intermediate_size"]
    shared = f.get("shared_expert_intermediate_size") or 0
    if experts == OUR_EXPERTS:  # tokens x 11 x width x 1 byte per unit = experts_kept_bytes at 2-byte dtypes
        routed = _experts_bytes_per_token(arch, 2) / 11 + shared
    else:
        expert *= CLAMPED_GLU if f.get("swiglu_limit") is not None else 1.0
        routed = k * expert + k * arch.hidden_size * 8 / 11 + shared
    return routed if sparse_every_layer(arch) else max(routed, dense)


def sparse_every_layer(arch: Arch) -> bool:
    """Whether every decoder layer is a mixture of experts (else the dense ones keep a dense MLP's bytes)."""
    return not arch.fields.get("mlp_only_layers") and arch.fields.get("decoder_sparse_step", 1) == 1


def lean_layer_bytes(arch: Arch, tokens: int, dtype_bytes: int, layer_numel: int, experts: str = "hf") -> int:
    """GPU bytes a lean decoder layer holds from its forward to its backward, for `tokens` tokens; `experts`:
    engine.moe_experts (a mixture of experts on our path is counted by _our_lean_mlp).

    Per token: the layer's input and the outputs of o and down (hidden each), of q and attention (heads x
    head_dim each), of k and v (kv heads x head_dim each), of gate and up (intermediate each; a mixture of
    experts' routed width, mlp_width), and the attention's fp32 log-sum-exp (one per head); plus the layer's
    weights in compute dtype, which the last block keeps until its backward (the lean call's input)."""
    q, kv = arch.attention_widths
    attention = q
    if has_sinks(arch.layout):  # the sinks' virtual key pads the attention's head dim (megatrain/layers/attention.py)
        attention = arch.num_attention_heads * -(-(arch.head_dim + 1) // 8) * 8
    if arch.is_moe and experts == OUR_EXPERTS:
        mlp = _our_lean_mlp(arch)
    elif experts_rerun(arch.layout):
        # the experts' grouped GEMMs run again in the backward: of the MLP half only the router's logits
        # (and a shared expert's GEMM outputs) are kept, not the routed rows
        shared = arch.fields.get("shared_expert_intermediate_size") or 0
        mlp = 2 * arch.hidden_size + arch.num_experts + (arch.hidden_size + 2 * shared if shared else 0)
    else:
        mlp = 3 * arch.hidden_size + 2 * mlp_width(arch)
    per_token = int((mlp + q + attention + 2 * kv) * dtype_bytes)
    return tokens * (per_token + 4 * arch.num_attention_heads) + layer_numel * dtype_bytes


def _our_lean_mlp(arch: Arch) -> int:
    """Per token, in compute-dtype elements, what a lean MoE layer on our expert path keeps beside q, k, v and
    attention, counted from its structure (all of them GEMM outputs the lean call caches; the rest of
    megatrain/layers/experts.py's forward, its sort and routing included, runs again): the layer's input and o's
    output (hidden each); the router's logits (one per expert); the routed rows' grouped GEMM outputs, each
    row's gate/up (2 x the expert width) and down (hidden), top-k rows per token, except where the experts'
    grouped GEMMs run again (experts_rerun: the lean call then caches no grouped GEMM); the combine's batched
    matmul output (hidden); a shared expert's gate and up (its width each), down (hidden) and sigmoid gate
    (one). Within 2 % of what the lean call caches on the CPU for each MoE family (tests/test_experts.py)."""
    hidden, k = arch.hidden_size, arch.experts_per_token
    routed = 0 if experts_rerun(arch.layout) else k * (2 * arch.moe_intermediate_size + hidden)
    shared = arch.shared_expert_intermediate_size
    mlp = 3 * hidden + arch.num_experts + routed + (2 * shared + hidden + 1 if shared else 0)
    # the dense layers of a model not sparse everywhere keep their gate, up and down outputs
    return mlp if sparse_every_layer(arch) else max(mlp, 3 * hidden + 2 * arch.fields["intermediate_size"])


def experts_rerun(layout: StoreLayout) -> bool:
    """Whether a lean layer runs its experts' grouped GEMMs again in the backward: where the experts carry
    biases (GPT-OSS), which HF adds in place into the GEMM's output, so that output cannot be kept."""
    return _has_slot(layout, "experts.gate_up_proj_bias")


def has_sinks(layout: StoreLayout) -> bool:
    """Whether attention has sinks (GPT-OSS)."""
    return _has_slot(layout, "self_attn.sinks")


def _has_slot(layout: StoreLayout, suffix: str) -> bool:
    return any(s.name.endswith(suffix) for st in layout.structures.values() for s in st.slots)
