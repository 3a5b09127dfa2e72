"""The plain reference: the same HF model held whole in one process, torch.optim.AdamW, same batches.

Tests compare MegaTrain against it step by step; the GPU fidelity check runs it with bf16 autocast.
A batch with positions (data.pack_documents) passes them as HF's position_ids: with no attention mask,
HF's own masks then keep attention inside each packed document (transformers' packed-sequence detection).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatrain.host.adamw import OptimConfig, lr_at
from megatrain.layers.labels import IGNORE, targets

Batches = Callable[[int], tuple[torch.Tensor, ...]]  # (ids, labels) or (ids, labels, positions)


@dataclass
class ReferenceResult:
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]
    eval_loss: float | None = None  # of the final weights, over the evaluation batches, token-weighted
    aux_losses: list[float] = field(default_factory=list)  # MoE with output_router_logits: HF's aux_loss


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if not (cfg.no_decay_1d and p.dim() < 2)]
    rest = [p for p in model.parameters() if cfg.no_decay_1d and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def train_reference(
    model: torch.nn.Module,
    optim: OptimConfig,
    batches: Batches,
    steps: int,
    device: str = "cpu",
    autocast_bf16: bool = False,
    eval_batches: list[tuple[torch.Tensor, ...]] | None = None,
) -> ReferenceResult:
    """`batches(t)` gives step t's (ids, labels[, positions]), the batches MegaTrain trained on; the final
    weights' loss over `eval_batches` is the mean over all their labelled tokens."""
    model = model.to(device).float().train()
    opt = make_optimizer(model, optim)
    losses, norms, auxes = [], [], []
    for t in range(steps):
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast_bf16):
            out = model(**_inputs(batches(t), device))
        loss = out.loss
        loss.backward()
        lm = float(loss.detach())
        if getattr(out, "aux_loss", None) is not None:  # HF's loss adds coef·aux; MegaTrain logs the two apart
            auxes.append(float(out.aux_loss.detach()))
            lm -= model.config.router_aux_loss_coef * auxes[-1]
        max_norm = optim.max_grad_norm if optim.max_grad_norm > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        for g in opt.param_groups:
            g["lr"] = lr_at(optim, t, steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(lm)
    state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return ReferenceResult(losses, norms, state, _eval_loss(model, eval_batches, device, autocast_bf16), auxes)


@torch.no_grad()
def _eval_loss(model: torch.nn.Module, batches: list | None, device: str, autocast_bf16: bool) -> float | None:
    if not batches:
        return None
    total, tokens = 0.0, 0
    for batch in batches:
        n = int((targets(batch[1]) != IGNORE).sum())
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast_bf16):
            loss = model(**_inputs(batch, device)).loss
        total, tokens = total + float(loss) * n, tokens + n
    return total / max(tokens, 1)


def _inputs(batch: tuple[torch.Tensor, ...], device: str) -> dict[str, torch.Tensor]:
    if len(batch) > 2:
        try:  # without it HF would attend across the packed documents: a silently different reference
            from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "the plain reference of data.pack_documents needs a transformers with packed-sequence masks "
                "(transformers.masking_utils.find_packed_sequence_indices)"
            ) from None
    names = ("input_ids", "labels", "position_ids")
    return {name: x.to(device) for name, x in zip(names, batch)}
