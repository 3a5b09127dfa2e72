"""Useful work per step, by the paper's formula: what TFLOPS means everywhere in MegaTrain."""

from __future__ import annotations

from megatrain.model import ModelSpec


def step_flops(num_params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """6·N·D + 12·L·H·S·D for N parameters and D tokens per step (recompute is not useful work)."""
    return 6 * num_params * tokens + 12 * layers * hidden * seq * tokens


def model_step_flops(spec: ModelSpec, batch: int, seq: int) -> float:
    """step_flops of a model for a batch of `batch` sequences of `seq` tokens."""
    return step_flops(spec.layout.num_params, spec.layout.num_layers, spec.hf_config.hidden_size, seq, batch * seq)
