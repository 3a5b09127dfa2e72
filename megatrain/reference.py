"""The plain reference: the same HF model held whole in one process, torch.optim.AdamW, same batches.

Tests compare MegaTrain against it step by step; the GPU fidelity check runs it with bf16 autocast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.adamw import OptimConfig, lr_at
from megatrain.data import DataConfig, batch


@dataclass
class ReferenceResult:
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if not (cfg.no_decay_1d and p.dim() < 2)]
    rest = [p for p in model.parameters() if cfg.no_decay_1d and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def train_reference(model: torch.nn.Module, optim: OptimConfig, data: DataConfig, steps: int,
                    device: str = "cpu", autocast_bf16: bool = False) -> ReferenceResult:
    model = model.to(device).float().train()
    opt = make_optimizer(model, optim)
    losses, norms = [], []
    for t in range(steps):
        ids, labels = (x.to(device) for x in batch(data, t))
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast_bf16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        max_norm = optim.max_grad_norm if optim.max_grad_norm > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        for g in opt.param_groups:
            g["lr"] = lr_at(optim, t, steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return ReferenceResult(losses, norms, state)
