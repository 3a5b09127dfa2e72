"""Useful work per step, by the paper's formula: what TFLOPS means everywhere in MegaTrain.

Free of torch: a model is given as its Arch (megatrain/model/arch.py), or as the ModelSpec a run holds, described
as one on the way in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatrain.model.arch import Arch, arch_of_spec, is_expert_slot

if TYPE_CHECKING:
    from megatrain.model.spec import ModelSpec


def _arch(model: Arch | ModelSpec) -> Arch:
    return model if isinstance(model, Arch) else arch_of_spec(model)


def step_flops(num_params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """6·N·D + 12·L·H·S·D for N (active) parameters and D tokens per step (recompute is not useful work).
    H is the attention's width, heads x head_dim: the paper's hidden size wherever head_dim is hidden / heads."""
    return 6 * num_params * tokens + 12 * layers * hidden * seq * tokens


def active_params(model: Arch | ModelSpec) -> int:
    """Parameters a token computes with: all of a dense model; of a mixture of experts, every routed
    expert tensor counts top-k / experts of its size (megatrain/layers/moe.py)."""
    arch = _arch(model)
    share = arch.active_fraction
    total = 0.0
    for u in arch.layout.units:
        for s in arch.layout.structure_of(u.index).slots:
            total += s.numel * (share if is_expert_slot(s.name) else 1.0)
    return int(total)


def expert_params(model: Arch | ModelSpec) -> int:
    """The routed experts' parameters, every expert of every layer (a shared expert is not one of them)."""
    layout = model.layout
    return sum(s.numel for u in layout.units for s in layout.structure_of(u.index).slots if is_expert_slot(s.name))


def model_step_flops(model: Arch | ModelSpec, batch: int, seq: int) -> float:
    """step_flops of a model for a batch of `batch` sequences of `seq` tokens, by its active parameters."""
    arch = _arch(model)
    width = arch.attention_widths[0]  # q·kᵀ and the weighted sum of v run over the heads' width
    return step_flops(active_params(arch), arch.layout.num_layers, width, seq, batch * seq)
