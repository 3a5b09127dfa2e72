"""Useful work per step, by the paper's formula: what TFLOPS means everywhere in MegaTrain."""

from __future__ import annotations


def step_flops(num_params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """6·N·D + 12·L·H·S·D for N parameters and D tokens per step (recompute is not useful work)."""
    return 6 * num_params * tokens + 12 * layers * hidden * seq * tokens
