"""Useful work per step, by the paper's formula: what TFLOPS means everywhere in MegaTrain."""

from __future__ import annotations

from megatrain.model import ModelSpec, attention_widths
from megatrain.moe import active_fraction, is_expert_slot


def step_flops(num_params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """6·N·D + 12·L·H·S·D for N (active) parameters and D tokens per step (recompute is not useful work).
    H is the attention's width, heads x head_dim: the paper's hidden size wherever head_dim is hidden / heads."""
    return 6 * num_params * tokens + 12 * layers * hidden * seq * tokens


def active_params(spec: ModelSpec) -> int:
    """Parameters a token computes with: all of a dense model; of a mixture of experts, every routed
    expert tensor counts top-k / experts of its size (megatrain/moe.py)."""
    share = active_fraction(spec.hf_config)
    total = 0.0
    for u in spec.layout.units:
        for s in spec.layout.structure_of(u.index).slots:
            total += s.numel * (share if is_expert_slot(s.name) else 1.0)
    return int(total)


def expert_params(spec: ModelSpec) -> int:
    """The routed experts' parameters, every expert of every layer (a shared expert is not one of them)."""
    layout = spec.layout
    return sum(s.numel for u in layout.units for s in layout.structure_of(u.index).slots if is_expert_slot(s.name))


def model_step_flops(spec: ModelSpec, batch: int, seq: int) -> float:
    """step_flops of a model for a batch of `batch` sequences of `seq` tokens, by its active parameters."""
    width = attention_widths(spec.hf_config)[0]  # q·kᵀ and the weighted sum of v run over the heads' width
    return step_flops(active_params(spec), spec.layout.num_layers, width, seq, batch * seq)
