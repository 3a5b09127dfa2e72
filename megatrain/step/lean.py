"""Lean layers: a decoder layer that keeps only its matmul and attention outputs for its backward.

A layer in the last block keeps its activations on the GPU from its forward to its backward, and
that memory decides how many layers the last block holds (each one it cannot hold is recomputed:
a whole forward again). Most of a layer's saved bytes are cheap to make again: the RMSNorms' fp32
copies and normed outputs, the activation function's input and output, the gated product, RoPE'd
queries and keys. A lean layer runs under torch's selective activation checkpointing: the outputs of
the GEMMs and of attention are cached in the forward, everything else is dropped and recomputed from
them in the backward (elementwise kernels only, no GEMM runs twice). On the Qwen2.5-7B layer at 64k
tokens on an H200 (bench/lean.py): 6.5 GiB kept instead of 13.8, for 15 ms more backward on a 175 ms
forward+backward (9 %), where a layer left out of the last block costs its 56 ms forward again and a
second transfer of its weights.

Generic over the families: the policy looks at aten ops, not at module classes. The recompute runs
the same kernels on the same inputs, so gradients are bit for bit those of the plain layer (tested).
Layers may not draw random numbers (no dropout); the block recompute already assumes that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megatrain.memory.layer import experts_rerun as experts_rerun  # what a lean layer keeps: sized there

_aten = torch.ops.aten
# The GEMMs (F.linear lowers to mm, or addmm with a bias) and every fused attention kernel SDPA may pick;
# their outputs are what a backward cannot get back without paying their FLOPs again.
_SAVED_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_grouped_mm",  # the experts of a mixture-of-experts layer, grouped (megatrain/layers/moe.py)
)
SAVED_OPS = frozenset(getattr(_aten, n).default for n in _SAVED_NAMES if hasattr(_aten, n))


def _policy(saved: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


# Experts with biases (GPT-OSS) get them added in place into the grouped GEMM's output (HF's grouped
# experts path), which a saved output cannot take: for those the grouped GEMM runs again in the backward.
_GROUPED = frozenset(op for op in SAVED_OPS if op.name().endswith("_grouped_mm"))
_CONTEXTS = {
    True: functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, SAVED_OPS)),
    False: functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, SAVED_OPS - _GROUPED)),
}


def lean_call(fn: Callable[..., torch.Tensor], *args, save_grouped: bool = True) -> torch.Tensor:
    """fn(*args) keeping only SAVED_OPS' outputs for the backward (with grad enabled; else a plain call)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    # preserve_rng_state: no layer draws random numbers, and stashing the CUDA generator per layer costs
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=_CONTEXTS[save_grouped])
