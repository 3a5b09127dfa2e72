"""Mixture-of-experts layers: the routers' statistics across layers, the load-balancing loss, expert load.

HF's MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS) run here as their own decoder layers;
what a layer-streamed engine must add is the auxiliary loss. HF defines it (`load_balancing_loss_func`,
added as `router_aux_loss_coef · aux` when `output_router_logits` is set) over the router logits of all
layers together:

    aux = E · Σ_e (C_e / N) · (S_e / N)

with C_e the top-k assignments to expert e and S_e the sum of its softmax probabilities, both over the
N = layers × tokens router rows of the step. C is not differentiable, S is: the gradient of
coef · aux with respect to one layer's probabilities is coef · E · C_e / N², the same for every row, and
it needs C over every layer, which is complete only when the whole forward has run. So the routers'
forward hooks count C and S while the engine's forward runs (RouterStats.counting), and a gradient hook
on each router's logits adds the aux term's gradient when the backward reaches it, reading C then.
The engine's backward of any layer starts after the last layer's forward of the same tokens; with
sequence chunks the last block first runs a counting forward over all chunks (engine.py).

The routers are found through HF's own record of them (`_can_record_outputs["router_logits"]`), so a
family that reports router logits to HF reports them here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megatrain.collective import Group
from megatrain.model.arch import is_expert_slot as is_expert_slot  # its home is the torch-free arch.py

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class MoeInfo:
    num_experts: int
    coef: float  # router_aux_loss_coef
    aux: bool  # output_router_logits: the load-balancing loss is part of the objective (HF's semantics)
    router: type  # the module class whose output[0] is a layer's router logits


def moe_info(model: torch.nn.Module) -> MoeInfo | None:
    """The model's MoE facts, or None for a dense model."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        return None
    hf = model.config
    return MoeInfo(
        num_experts=num_experts(hf),
        coef=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
        aux=bool(getattr(hf, "output_router_logits", False)),
        router=recorder.target_class,
    )


def num_experts(hf: PretrainedConfig) -> int:
    return int(getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", 0) or 0)


def is_moe(hf: PretrainedConfig) -> bool:
    return num_experts(hf) > 0 and bool(getattr(hf, "num_experts_per_tok", 0))


def active_fraction(hf: PretrainedConfig) -> float:
    """The share of a routed expert tensor a token uses: top-k of E."""
    return hf.num_experts_per_tok / num_experts(hf) if is_moe(hf) else 1.0


class RouterStats:
    """One step's router statistics, on the compute device: per MoE layer the tokens each expert took
    (C, for the load metric and the aux loss) and over all layers the summed probabilities (S)."""

    def __init__(self, info: MoeInfo, units: list[int], device: torch.device):
        self.info, self.units = info, units
        self.row = {u: i for i, u in enumerate(units)}
        self.counts = torch.zeros(len(units), info.num_experts, dtype=torch.float32, device=device)
        self.probs = torch.zeros(info.num_experts, dtype=torch.float32, device=device)
        self.rows = 0
        self.total: torch.Tensor | None = None  # N summed over the executors (counted())
        self.counting = False
        self.unit = 0  # the layer unit running now (the engine sets it before each layer call)
        self.inject = info.aux and info.coef != 0.0

    def reset(self) -> None:
        self.counts.zero_()
        self.probs.zero_()
        self.rows, self.counting, self.total = 0, False, None

    def counted(self, group: Group | None) -> None:
        """The step's counting is over. With several executors each counted its own rows: the statistics
        become the whole batch's (summed over the executors) before any gradient hook reads them."""
        if group is None:
            return
        rows = torch.full((1,), float(self.rows), dtype=torch.float64, device=self.counts.device)
        flat = torch.cat([self.counts.reshape(-1).double(), self.probs.double(), rows])  # fp64: N past 2^24
        group.all_reduce_(flat)
        n = self.counts.numel()
        self.counts.copy_(flat[:n].view_as(self.counts))
        self.probs.copy_(flat[n:-1])
        self.total = flat[-1:].float()  # a device value: reading it on the host would wait for the sum

    def _n(self) -> float | torch.Tensor:
        """N: the router rows of the step (the whole batch's)."""
        return float(max(self.rows, 1)) if self.total is None else self.total.clamp(min=1.0)

    def hook(self, module: torch.nn.Module, args: tuple, output: tuple) -> None:
        """Forward hook of every router module: count while counting; with grad, hook the logits."""
        logits, indices = output[0], output[2]
        if self.counting:
            with torch.no_grad():
                flat = indices.reshape(-1)
                self.counts[self.row[self.unit]].index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
                self.probs += F.softmax(logits.detach().float(), dim=-1).sum(0)
                self.rows += logits.shape[0]
        if self.inject and logits.requires_grad and torch.is_grad_enabled():
            logits.register_hook(functools.partial(self._aux_grad, logits.detach()))

    def _aux_grad(self, logits: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """grad + d(coef · aux)/d logits for these rows: the softmax's Jacobian applied to coef·E·C/N²."""
        n = self._n()
        w = self.counts.sum(0) * (self.info.coef * self.info.num_experts / (n * n))
        p = F.softmax(logits.float(), dim=-1)
        return grad + (p * (w - (p * w).sum(-1, keepdim=True))).to(grad.dtype)

    def aux_loss(self) -> torch.Tensor:
        """HF's load-balancing loss of the step (before the coefficient), a device scalar."""
        n = self._n()
        return (self.counts.sum(0) / n * (self.probs / n)).sum() * self.info.num_experts

    def load(self) -> list[list[int]]:
        """Tokens (top-k assignments) per expert per MoE layer; a host sync."""
        return self.counts.round().long().tolist()
