"""AdamW's settings (the config tree's `optim` section). Free of numba, so the config tree and its checks load
without it; megatrain/host/adamw.py, the update itself, imports them from here."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config.base import opt


@dataclass
class OptimConfig:
    lr: float = opt(1e-3, "Peak learning rate.")
    betas: tuple[float, float] = opt((0.9, 0.95), "Adam beta1, beta2.")
    eps: float = opt(1e-8, "Adam epsilon (added to sqrt(v_hat)).")
    weight_decay: float = opt(0.0, "Decoupled weight decay (AdamW).")
    no_decay_1d: bool = opt(True, "Exempt 1-D tensors (norms, biases) from weight decay.")
    max_grad_norm: float = opt(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    schedule: str = opt("cosine", "LR schedule after warmup: constant, linear or cosine (decay to min_lr_ratio).")
    warmup_steps: int = opt(0, "Linear warmup steps from 0 to lr.")
    min_lr_ratio: float = opt(0.1, "Final LR as a fraction of lr for linear/cosine.")

    @property
    def clips(self) -> bool:
        """Global-norm clipping is on: the gradient plane, the accumulators, no update before the norm."""
        return self.max_grad_norm > 0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.eps <= 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("optim: lr and eps must be > 0, weight_decay and max_grad_norm >= 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas {self.betas} must lie in [0, 1)")
        if self.schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.schedule must be constant, linear or cosine, not '{self.schedule}'")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("optim.warmup_steps must be >= 0 and optim.min_lr_ratio in [0, 1]")
