"""The LM head and its loss in token chunks (engine.loss_chunk_tokens): the [tokens, vocab] logits of a whole
step never exist, and the head's weight gradients are summed in fp32 over the chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

IGNORE = -100  # the label of a token without one (megatrain/data)

if TYPE_CHECKING:
    from megatrain.engine import StepEngine


class ChunkedHead:
    """Norm + LM head + loss in token chunks, backward per chunk: [tokens, vocab] never exists.

    Its weight gradients (and the tied embedding's) are summed in fp32 over all chunks of the step."""

    def __init__(self, engine: StepEngine, emb_flat: torch.Tensor | None, denom: torch.Tensor):
        self.e, self.emb_flat, self.denom = engine, emb_flat, denom
        self.flat: torch.Tensor | None = None
        self.sums: list[torch.Tensor] = []
        self.loss = torch.zeros((), dtype=torch.float32, device=engine.device)

    def chunk(self, h: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Loss of one sequence chunk's tokens (added to the step's); returns d loss / d h."""
        leaves = [self.flat] + ([self.emb_flat.requires_grad_(True)] if self.emb_flat is not None else [])
        if not self.sums:
            self.sums = [torch.zeros(t.numel(), dtype=torch.float32, device=self.e.device) for t in leaves]
        x_all = h.detach().reshape(-1, h.shape[-1])
        tgt = tgt.reshape(-1)
        grad_x = torch.empty_like(x_all)
        step = self.e.cfg.loss_chunk_tokens
        for c in range(0, x_all.shape[0], step):
            xc = x_all[c : c + step].detach().requires_grad_(True)
            logits = self.e.t.head(self.flat, self.emb_flat, xc)
            lc = F.cross_entropy(logits.float(), tgt[c : c + step], ignore_index=IGNORE, reduction="sum") / self.denom
            lc.backward()
            grad_x[c : c + step] = xc.grad
            for acc, leaf in zip(self.sums, leaves):
                acc += leaf.grad  # fp32 sum over chunks, whatever the compute dtype
                leaf.grad = None
            self.loss += lc.detach()
        return grad_x.view(h.shape)
