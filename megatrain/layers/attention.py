"""The attention function the layers run: HF's SDPA path, plus sliding windows with O(sequence) memory and
GPT-OSS's attention sinks.

The engine calls HF decoder layers without an attention mask (the causal pattern goes to SDPA as
`is_causal`, which lets it pick the flash / memory-efficient kernels). HF builds sliding-window masks in
the model's forward, which the engine does not run, so its SDPA function would silently attend to the
whole causal past. model.family_classes registers this function with HF's attention interface under
model.ATTENTION, which is every model's `_attn_implementation` (megatrain/model/spec.py): a layer with
`sliding_window` W (the call's argument, else the attention module's attribute, which is all Qwen2-MoE
gives) shorter than the sequence attends in query tiles of W tokens, each to the keys of its window only
(HF's rule: key j is seen by query i when i - W < j <= i), through SDPA with that tile's mask; every other layer takes
HF's SDPA function unchanged. Memory is O(sequence · W) for the masks' tiles, never sequence².

Attention sinks (GPT-OSS: the layer kwarg `s_aux`, one logit per query head): each query's softmax also
takes the logit sink[h], whose probability is then dropped (HF's eager_attention_forward for GPT-OSS). HF's
SDPA function ignores `s_aux`; here the sink is one more key, so that SDPA and its kernels still run it: q
gains the column sink[h] / scale and every real key a zero column, and a virtual key, put first, is zero
but for a 1 in that column, with a zero value. Its score is sink[h] for every query, the real scores are
unchanged, and it adds nothing to the output. Query i sees the virtual key and real keys 0..i: with one
zero query put first as well, that is the square causal pattern (`is_causal`), and the extra output row is
dropped; a window tile and HF's mask take the virtual key as one more column every query sees. The head
width is padded with zeros to a multiple of 8 (the CUDA kernels' rule; zeros change no score).

Packed documents (data.pack_documents; megatrain/layers/documents.py): the layer kwarg `documents` gives each
row's document lengths, and attention runs per document, each causal (or windowed, where the layer's
window is shorter than the document), so no token attends across a document boundary and memory stays
O(document). It costs one attention call per document per layer (and per row): cheap for a few long
documents, launch-bound for many short ones, where a varlen flash kernel would take a row in one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scale: float | None,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention restricted to the last `window` keys per query, for [batch, heads, seq, dim] inputs
    (k and v may have fewer heads: grouped-query attention). `sink`: a key and a value [batch, kv heads, 1,
    dim] every query sees besides its window (the virtual sink key, _sink_inputs). Returns [batch, seq,
    heads, dim]."""
    groups = q.shape[1] // k.shape[1]
    seq, out = q.shape[2], []
    for s in range(0, seq, window):
        e, ks = min(s + window, seq), max(0, s - window + 1)
        kt, vt = k[:, :, ks:e], v[:, :, ks:e]
        qpos = torch.arange(s, e, device=q.device).unsqueeze(1)
        kpos = torch.arange(ks, e, device=q.device).unsqueeze(0)
        mask = (kpos <= qpos) & (kpos > qpos - window)
        if sink is not None:  # one more key, first, outside every window
            kt, vt = torch.cat([sink[0], kt], dim=2), torch.cat([sink[1], vt], dim=2)
            mask = torch.cat([mask.new_ones(e - s, 1), mask], dim=1)
        if groups > 1:  # on the tile's keys only; the memory-efficient kernel takes no grouped heads with a mask
            kt, vt = kt.repeat_interleave(groups, dim=1), vt.repeat_interleave(groups, dim=1)
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], kt, vt, attn_mask=mask, scale=scale))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()


def _sink_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float, lead: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [batch, heads, seq, dim] with the sinks as a virtual key (module docstring): q [.., lead + seq,
    width] (`lead` zero queries first, then each query with sink[h] / scale in column `dim`), k and v [..,
    1 + seq, width] (the virtual key first: 1 in k's column `dim`, a zero value), width the next multiple
    of 8 above q's and v's widths."""
    dim = q.shape[-1]
    width = -(-max(dim + 1, v.shape[-1]) // 8) * 8
    q = F.pad(q, (0, width - dim, lead, 0))
    # in place into pad's output, which its backward does not keep; the sinks' gradient flows through it
    q[:, :, lead:, dim] = (sinks / scale).to(q.dtype).view(1, -1, 1)
    k = F.pad(k, (0, width - dim, 1, 0))
    k[:, :, 0, dim] = 1
    v = F.pad(v, (0, width - v.shape[-1], 1, 0))
    return q, k, v


def _with_sinks(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    sinks: torch.Tensor,
    kwargs: dict,
) -> torch.Tensor:
    """_one_sequence with attention sinks (`sinks`: one logit per query head); returns [batch, seq, heads,
    dim]."""
    if 1 < q.shape[2] != k.shape[2]:  # the zero lead query aligns the causal pattern for a square one only
        raise ValueError("attention sinks without a mask need as many keys as queries (no KV cache)")
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5  # the padded width would change SDPA's default
    dim = v.shape[-1]
    if sliding_window and q.shape[2] > sliding_window:
        if dropout:
            raise ValueError("attention dropout is not supported")
        q, k, v = _sink_inputs(q, k, v, sinks, scale, lead=0)
        out = windowed_attention(q, k[:, :, 1:], v[:, :, 1:], sliding_window, scale, (k[:, :, :1], v[:, :, :1]))
        return out[..., :dim]
    # one zero query first (none for a single query, which sees every key): its row of SDPA's upper-left
    # causal mask sees the virtual key only, and query i the virtual key and real keys 0..i
    lead = int(q.shape[2] > 1)
    q, k, v = _sink_inputs(q, k, v, sinks, scale, lead)
    out = sdpa_attention_forward(
        module, q, k, v, None, dropout=dropout, scaling=scale, sliding_window=sliding_window, **kwargs
    )[0]
    return out[:, lead:, :, :dim]


def _masked_with_sinks(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    dropout: float,
    sinks: torch.Tensor,
    kwargs: dict,
) -> torch.Tensor:
    """HF's SDPA function under a mask HF built (boolean or additive, [.., queries, keys]), with attention
    sinks: the virtual key is one more column, first, that every query sees. Returns [batch, seq, heads,
    dim]."""
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    dim = v.shape[-1]
    q, k, v = _sink_inputs(q, k, v, sinks, scale, lead=0)
    seen = mask.new_ones(*mask.shape[:-1], 1) if mask.dtype == torch.bool else mask.new_zeros(*mask.shape[:-1], 1)
    mask = torch.cat([seen, mask], dim=-1)
    return sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scale, **kwargs)[0][..., :dim]


def _one_sequence(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kwargs: dict,
) -> torch.Tensor:
    """Causal attention over q, k, v [batch, heads, seq, dim] (no mask), windowed where the window is
    shorter than the sequence, with the attention sinks where given; returns [batch, seq, heads, dim]."""
    if sinks is not None:
        return _with_sinks(module, q, k, v, scaling, dropout, sliding_window, sinks, kwargs)
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
    sinks: torch.Tensor | None,
    kwargs: dict,
) -> torch.Tensor:
    """Attention within each document of each row (`documents`: per row, its documents' lengths in order),
    for [batch, heads, seq, dim] inputs, each document with its own sinks where given; returns [batch, seq,
    heads, dim]."""
    rows = []
    for b, lengths in enumerate(documents):
        parts = [
            _one_sequence(module, qd, kd, vd, scaling, dropout, sliding_window, sinks, kwargs)
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
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if sliding_window is None:
        # Qwen2-MoE's sliding layers record their window on the module and do not pass it (HF's eager and SDPA
        # paths see it in the mask its forward builds; the engine builds none)
        sliding_window = getattr(module, "sliding_window", None)
    if attention_mask is not None and s_aux is not None:  # a mask HF built (its own forward), with sinks
        return _masked_with_sinks(module, query, key, value, attention_mask, scaling, dropout, s_aux, kwargs), None
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
        out = document_attention(module, query, key, value, documents, scaling, dropout, sliding_window, s_aux, kwargs)
        return out, None
    return _one_sequence(module, query, key, value, scaling, dropout, sliding_window, s_aux, kwargs), None
