"""Labels: the label of a token without one, and which label each position's loss takes.

Import-free, so that the data path (numpy) and the engine (torch) share these without either importing
the other's world."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE = -100  # the label of a token without one: no loss, not counted (torch's and HF's ignore_index)


def targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target, [B, S]: labels are aligned with the ids and position j predicts labels[j + 1],
    so the row's last position predicts nothing (IGNORE)."""
    out = labels.new_full(labels.shape, IGNORE)
    out[:, :-1] = labels[:, 1:]
    return out
