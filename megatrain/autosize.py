"""`auto` engine sizes: the fastest setting that fits the GPU memory actually free.

What costs time, what costs memory (one step, L layers, K = engine.checkpoint_interval):
  * every layer outside the last block is recomputed once in the backward (about a third of its
    forward+backward again, and its weights cross PCIe again); a layer in the last block is not, but
    keeps its activations on the GPU from its forward to its backward. So the last block gets as many
    layers as the free memory holds: that is the speed lever.
  * the last block's activations are freed by its backward before any recompute block runs, so the
    recompute blocks (K layers each) need room for K layers at once, not in addition. K itself barely
    changes the time (the recompute is one forward per layer whatever K), and a smaller K offloads more
    checkpoints to pinned host RAM, so K stays 2 (1 when the GPU holds fewer than 2 layers' activations).
  * the batch runs through each layer in chunks of engine.chunk_sequences: whole when K layers of the
    whole batch fit, else the largest chunk that does (smaller chunks run the GEMMs less efficiently).
  * the LM head and loss run in chunks of engine.loss_chunk_tokens tokens, whose [tokens, vocab] logits
    (bf16, their fp32 upcast and its gradient: about 12 bytes per element) are the head's peak: 8192
    tokens where that is at most an eighth of the budget (larger chunks run the head's GEMMs faster).
Memory model, calibrated on the Qwen2.5-7B layer (bf16) against four measured GPU peaks (8 layers at
16x4096 with 1 and 2 layers in the last block and 2048/8192-token loss chunks; 28 layers with 6; 8
layers at 158x1024 with 2; all within 1.3 GiB):
  peak = weight buffers + loss chunk + tokens·12·hidden·dtype (hidden-state copies, the checkpoint in
         flight, the head's input) + last block · tokens·(4·hidden + 5.5·intermediate)·dtype
and it must stay under 92 % of the free memory the executor measured after its CUDA context.
On the CPU device nothing is scarce in this sense: the previous fixed defaults (K 2, last block K,
whole batch, 2048-token loss chunks).
"""

from __future__ import annotations

import dataclasses

from megatrain.engine import FIXED_SIZES, EngineConfig
from megatrain.errors import ResourceError
from megatrain.model import ModelSpec

GIB = 2**30
LOSS_BYTES = 12  # per logit element: bf16 logits, fp32 upcast, fp32 gradient of the upcast
MARGIN = 0.92  # of the free memory: the allocator's fragmentation and cuBLAS workspaces


@dataclasses.dataclass(frozen=True)
class Sizes:
    checkpoint_interval: int
    last_block_layers: int
    chunk_sequences: int
    loss_chunk_tokens: int


def layer_activation_bytes(spec: ModelSpec, tokens: int, dtype_bytes: int) -> int:
    """One decoder layer's activations kept for its backward, for `tokens` tokens."""
    hf = spec.hf_config
    return tokens * (8 * hf.hidden_size + 11 * hf.intermediate_size) * dtype_bytes // 2


def stream_bytes(spec: ModelSpec, tokens: int, dtype_bytes: int) -> int:
    """What grows with the tokens outside the layers: hidden-state copies, the checkpoint in flight."""
    return tokens * 12 * spec.hf_config.hidden_size * dtype_bytes


def buffer_bytes(spec: ModelSpec, prefetch: int, dtype_bytes: int) -> int:
    """Weight buffers: the unit computing and `prefetch` loading ahead, a decoder layer each (larger units
    stream through them in layer-sized pieces)."""
    layer = max(spec.layout.structure_of(u.index).numel for u in spec.layout.units if u.kind == "layer")
    return layer * (prefetch + 1) * dtype_bytes


def choose(spec: ModelSpec, cfg: EngineConfig, batch: int, seq: int, gpu_free: int | None) -> tuple[Sizes, str]:
    """The sizes for the `auto` fields of `cfg` (explicit values are kept), and why, in one line."""
    if gpu_free is None:
        return _keep(cfg, Sizes(**FIXED_SIZES)), "the CPU device: fixed defaults"
    dtype_bytes = 2 if cfg.compute_dtype == "bf16" else 4
    tokens = batch * seq
    budget = int(gpu_free * MARGIN) - buffer_bytes(spec, cfg.prefetch, dtype_bytes)
    loss = _loss_chunk(spec.hf_config.vocab_size, budget)
    budget -= loss * spec.hf_config.vocab_size * LOSS_BYTES + stream_bytes(spec, tokens, dtype_bytes)
    per_layer = layer_activation_bytes(spec, tokens, dtype_bytes)
    layers = spec.layout.num_layers
    fit = max(budget // per_layer, 0)
    k = 2 if fit >= 2 and layers >= 2 else 1
    last = int(min(max(fit, 1), layers))
    if k * per_layer / batch > budget and cfg.chunk_sequences == "auto":
        raise ResourceError(
            f"the GPU cannot hold one sequence of {seq} tokens through {k} layer(s): {gpu_free / GIB:.1f} GiB free, "
            f"{max(budget, 0) / GIB:.1f} GiB of it left for activations after the weight buffers, the loss chunk "
            f"and the hidden states, one sequence needs {k * per_layer / batch / GIB:.2f} GiB; use a shorter "
            f"data.seq_len or a GPU with more free memory (megatrain-launch plan CONFIG shows the whole plan)")
    chunk = 0 if k * per_layer <= budget else max(1, int(budget // (k * per_layer / batch)))
    sizes = _keep(cfg, Sizes(k, last, chunk, loss))
    why = (f"{gpu_free / GIB:.1f} GiB free on the GPU, {max(budget, 0) / GIB:.1f} GiB left for layer activations; "
           f"one layer's {per_layer / GIB:.2f} GiB for {batch}x{seq} tokens")
    return sizes, why


def gpu_terms(spec: ModelSpec, cfg: EngineConfig, batch: int, seq: int, sizes: Sizes) -> dict[str, int]:
    """GPU bytes of a step at the given sizes, by the model above, term by term (megatrain-launch plan). Plus
    what the rule leaves to its margin: the head's unit (the LM head or embedding, the largest) in bf16
    and its fp32 gradient, summed over the step; that is what the margin covers at small token counts."""
    hf, dtype_bytes = spec.hf_config, 2 if cfg.compute_dtype == "bf16" else 4
    chunk_tokens = (sizes.chunk_sequences or batch) * seq
    kept = max(sizes.last_block_layers or sizes.checkpoint_interval, sizes.checkpoint_interval)
    largest = spec.layout.max_unit_numel
    return {f"weight buffers ({cfg.prefetch + 1} layers, compute dtype)": buffer_bytes(spec, cfg.prefetch, dtype_bytes),
            f"loss chunk logits ({sizes.loss_chunk_tokens} tokens x vocab, 12 B each)":
                sizes.loss_chunk_tokens * hf.vocab_size * LOSS_BYTES,
            "hidden states, checkpoint in flight, head input": stream_bytes(spec, batch * seq, dtype_bytes),
            f"activations of {kept} layers ({chunk_tokens} tokens each)":
                kept * layer_activation_bytes(spec, chunk_tokens, dtype_bytes),
            "largest unit's weights and fp32 gradient": largest * (dtype_bytes + 4)}


def _loss_chunk(vocab: int, budget: int) -> int:
    tokens = 8192
    while tokens > 512 and tokens * vocab * LOSS_BYTES > budget / 8:
        tokens //= 2
    return tokens


def _keep(cfg: EngineConfig, auto: Sizes) -> Sizes:
    """Explicit config values win over the rule."""
    return Sizes(*(getattr(auto, f.name) if getattr(cfg, f.name) == "auto" else getattr(cfg, f.name)
                   for f in dataclasses.fields(Sizes)))


def apply(cfg: EngineConfig, sizes: Sizes) -> EngineConfig:
    return dataclasses.replace(cfg, **dataclasses.asdict(sizes))
