"""The attention function the layers run: HF's SDPA path, plus sliding windows with O(sequence) memory.

The engine calls HF decoder layers without an attention mask (the causal pattern goes to SDPA as
`is_causal`, which lets it pick the flash / memory-efficient kernels). HF builds sliding-window masks in
the model's forward, which the engine does not run, so its SDPA function would silently attend to the
whole causal past. This function is registered with HF's attention interface under model.ATTENTION and set as
every model's `_attn_implementation` (megatrain/model.py): a layer with `sliding_window` W shorter than
the sequence attends in query tiles of W tokens, each to the keys of its window only (HF's rule: key j
is seen by query i when i - W < j <= i), through SDPA with that tile's mask; every other layer takes
HF's SDPA function unchanged. Memory is O(sequence · W) for the masks' tiles, never sequence².

Packed documents (data.pack_documents; megatrain/documents.py): the layer kwarg `documents` gives each
row's document lengths, and attention runs per document, each causal (or windowed, where the layer's
window is shorter than the document), so no token attends across a document boundary and memory stays
O(document). It costs one attention call per document per layer (and per row): cheap for a few long
documents, launch-bound for many short ones, where a varlen flash kernel would take a row in one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from megatrain.model import ATTENTION


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float | None
) -> torch.Tensor:
    """Causal attention restricted to the last `window` keys per query, for [batch, heads, seq, dim] inputs
    (k and v may have fewer heads: grouped-query attention). Returns [batch, seq, heads, dim]."""
    groups = q.shape[1] // k.shape[1]
    seq, out = q.shape[2], []
    for s in range(0, seq, window):
        e, ks = min(s + window, seq), max(0, s - window + 1)
        kt, vt = k[:, :, ks:e], v[:, :, ks:e]
        if groups > 1:  # on the tile's keys only; the memory-efficient kernel takes no grouped heads with a mask
            kt, vt = kt.repeat_interleave(groups, dim=1), vt.repeat_interleave(groups, dim=1)
        qpos = torch.arange(s, e, device=q.device).unsqueeze(1)
        kpos = torch.arange(ks, e, device=q.device).unsqueeze(0)
        mask = (kpos <= qpos) & (kpos > qpos - window)
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], kt, vt, attn_mask=mask, scale=scale))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()


def _one_sequence(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    kwargs: dict,
) -> torch.Tensor:
    """Causal attention over q, k, v [batch, heads, seq, dim] (no mask), windowed where the window is
    shorter than the sequence; returns [batch, seq, heads, dim]."""
    if sliding_window and q.shape[2] > sliding_window:
        if dropout:
            raise ValueError("attention dropout is not supported")
        return windowed_attention(q, k, v, sliding_window, scaling)
    return sdpa_attention_forward(
        module, q, k, v, None, dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs
    )[0]


def document_attention(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: list[list[int]],
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    kwargs: dict,
) -> torch.Tensor:
    """Attention within each document of each row (`documents`: per row, its documents' lengths in order),
    for [batch, heads, seq, dim] inputs; returns [batch, seq, heads, dim]."""
    rows = []
    for b, lengths in enumerate(documents):
        parts = [
            _one_sequence(module, qd, kd, vd, scaling, dropout, sliding_window, kwargs)
            for qd, kd, vd in zip(*(t[b : b + 1].split(lengths, dim=2) for t in (q, k, v)))
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    documents: list[list[int]] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if attention_mask is not None:  # a mask HF built (its own forward): HF's function, unchanged
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if documents is not None and any(len(row) > 1 for row in documents):
        return document_attention(module, query, key, value, documents, scaling, dropout, sliding_window, kwargs), None
    return _one_sequence(module, query, key, value, scaling, dropout, sliding_window, kwargs), None


AttentionInterface.register(ATTENTION, attention)
