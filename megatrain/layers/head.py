"""The LM head and its loss in token chunks (engine.loss_chunk_tokens): the [tokens, vocab] logits of a whole
step never exist, and the head's weight gradients are summed in fp32 over the chunks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatrain.layers.labels import IGNORE

Logits = Callable[[torch.Tensor], torch.Tensor]  # a chunk's final hidden states -> its logits


def chunked_loss(
    logits_of: Logits,
    x: torch.Tensor,
    tgt: torch.Tensor,
    chunk_tokens: int,
    total: torch.Tensor,
    denom: torch.Tensor | None = None,
    backward: Callable[[slice, torch.Tensor], None] | None = None,
) -> None:
    """Adds to `total` the summed token loss of x's rows [tokens, hidden] against `tgt` [tokens] (IGNORE'd
    tokens excluded), over / `denom` where given, computed `chunk_tokens` tokens at a time so that the
    [tokens, vocab] logits never exist. With `backward`, each chunk's loss is back-propagated before the
    next chunk's logits are made, and backward(chunk, d loss / d x of the chunk) takes the gradients."""
    for c in range(0, x.shape[0], chunk_tokens):
        rows = slice(c, c + chunk_tokens)
        xc = x[rows].detach().requires_grad_(True) if backward is not None else x[rows]
        lc = F.cross_entropy(logits_of(xc).float(), tgt[rows], ignore_index=IGNORE, reduction="sum")
        if denom is not None:
            lc = lc / denom
        if backward is not None:
            lc.backward()
            backward(rows, xc.grad)
        total += lc.detach()


class ChunkedHead:
    """Norm + LM head + loss in token chunks, backward per chunk: [tokens, vocab] never exists.

    `head(flat, emb_flat, x)` is the layer templates' head. Its weight gradients (and the tied
    embedding's) are summed in fp32 over all chunks of the step."""

    def __init__(
        self,
        head: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor],
        chunk_tokens: int,
        device: torch.device,
        emb_flat: torch.Tensor | None,
        denom: torch.Tensor,
    ):
        self.head, self.chunk_tokens, self.device = head, chunk_tokens, device
        self.emb_flat, self.denom = emb_flat, denom
        self.flat: torch.Tensor | None = None
        self.sums: list[torch.Tensor] = []
        self.loss = torch.zeros((), dtype=torch.float32, device=device)

    def chunk(self, h: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Loss of one sequence chunk's tokens (added to the step's); returns d loss / d h."""
        leaves = [self.flat] + ([self.emb_flat.requires_grad_(True)] if self.emb_flat is not None else [])
        if not self.sums:
            self.sums = [torch.zeros(t.numel(), dtype=torch.float32, device=self.device) for t in leaves]
        x_all = h.detach().reshape(-1, h.shape[-1])
        grad_x = torch.empty_like(x_all)

        def take(rows: slice, grad: torch.Tensor) -> None:
            grad_x[rows] = grad
            for acc, leaf in zip(self.sums, leaves):
                acc += leaf.grad  # fp32 sum over chunks, whatever the compute dtype
                leaf.grad = None

        def logits_of(xc: torch.Tensor) -> torch.Tensor:
            return self.head(self.flat, self.emb_flat, xc)

        chunked_loss(logits_of, x_all, tgt.reshape(-1), self.chunk_tokens, self.loss, self.denom, take)
        return grad_x.view(h.shape)
