"""Attention sinks (GPT-OSS's `s_aux`, megatrain/layers/attention.py): the registered attention function against
HF's eager_attention_forward for GPT-OSS with an explicit causal / sliding-window mask, in fp32, outputs and
gradients for q, k, v and the sinks; full causal, windowed, grouped-query heads, packed documents, HF's
mask, no sinks; then a tiny GPT-OSS decoder layer and model, ours against HF's eager attention."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import (
    GptOssDecoderLayer,
    GptOssRotaryEmbedding,
    eager_attention_forward,
)

from megatrain.layers.attention import attention
from megatrain.model.spec import ATTENTION, family_classes

family_classes("gpt_oss")  # registers our attention function under ATTENTION, as every model build does


class _Attn(torch.nn.Module):
    """What HF's SDPA and GPT-OSS eager functions read off the attention module."""

    def __init__(self, heads: int, kv_heads: int, generator: torch.Generator) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True
        self.sinks = torch.nn.Parameter(torch.randn(heads, generator=generator))


def _mask(seq: int, window: int | None) -> torch.Tensor:
    """HF's rule as a boolean [seq, seq]: key j seen by query i when j <= i (and i - W < j, windowed)."""
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    return (j <= i) & (j > i - window) if window else j <= i


def _additive(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def _inputs(heads: int, kv_heads: int, seq: int, dim: int, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    module = _Attn(heads, kv_heads, g).eval()
    q = torch.randn(batch, heads, seq, dim, generator=g, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, generator=g, requires_grad=True)
    return module, q, k, v, torch.randn(batch, seq, heads, dim, generator=g)


def _grads(out: torch.Tensor, weight: torch.Tensor, *leaves: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * weight).sum(), leaves))


def _check(got: torch.Tensor, want: torch.Tensor, weight: torch.Tensor, leaves: tuple) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(_grads(got, weight, *leaves), _grads(want, weight, *leaves)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("dim", [8, 13])
@pytest.mark.parametrize("seq, window", [(12, None), (12, 16), (24, 5), (7, 3), (9, 1)])
def test_sinks_match_hf_eager(seq: int, window: int | None, dim: int, heads: int, kv_heads: int) -> None:
    """Full causal (also under a window wider than the sequence), windowed tiles, grouped-query heads,
    head widths on and off a multiple of 8 (the padding); gradients reach the sinks."""
    module, q, k, v, weight = _inputs(heads, kv_heads, seq, dim)
    scale = dim**-0.5
    got = attention(module, q, k, v, None, scaling=scale, sliding_window=window, s_aux=module.sinks)[0]
    want = eager_attention_forward(module, q, k, v, _additive(_mask(seq, window)), scaling=scale)[0]
    _check(got, want, weight, (q, k, v, module.sinks))


def test_the_default_scale_is_the_head_width_before_padding() -> None:
    module, q, k, v, weight = _inputs(4, 2, 10, 12)
    got = attention(module, q, k, v, None, s_aux=module.sinks)[0]
    want = eager_attention_forward(module, q, k, v, _additive(_mask(10, None)), scaling=12**-0.5)[0]
    _check(got, want, weight, (q, k, v, module.sinks))


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_per_document(window: int | None) -> None:
    """Packed rows [[5, 7], [12]]: each document against eager on that document alone."""
    module, q, k, v, weight = _inputs(6, 2, 12, 8)
    got = attention(
        module, q, k, v, None, scaling=0.3, sliding_window=window, documents=[[5, 7], [12]], s_aux=module.sinks
    )[0]
    parts = []
    for b, lengths in enumerate([[5, 7], [12]]):
        row = [
            eager_attention_forward(module, qd, kd, vd, _additive(_mask(qd.shape[2], window)), scaling=0.3)[0]
            for qd, kd, vd in zip(*(t[b : b + 1].split(lengths, dim=2) for t in (q, k, v)))
        ]
        parts.append(torch.cat(row, dim=1))
    _check(got, torch.cat(parts, dim=0), weight, (q, k, v, module.sinks))


@pytest.mark.parametrize("boolean", [True, False])
def test_sinks_under_a_mask_hf_built(boolean: bool) -> None:
    """A mask passed in (HF's own forward): the sinks are kept, boolean or additive."""
    module, q, k, v, weight = _inputs(6, 3, 10, 8)
    mask = _mask(10, 4).expand(2, 1, 10, 10).clone()
    mask[0, :, :, :2] = False  # left padding in the first row
    mask[0, :, :2, :2] = torch.eye(2, dtype=torch.bool)
    given = mask if boolean else _additive(mask)
    got = attention(module, q, k, v, given, scaling=0.25, sliding_window=4, s_aux=module.sinks)[0]
    want = eager_attention_forward(module, q, k, v, _additive(mask), scaling=0.25)[0]
    _check(got, want, weight, (q, k, v, module.sinks))


@pytest.mark.parametrize("seq, window", [(12, None), (24, 5)])
def test_without_sinks_nothing_changes(seq: int, window: int | None) -> None:
    """No `s_aux`: plain softmax attention, against SDPA with the whole mask."""
    module, q, k, v, weight = _inputs(6, 2, seq, 8)
    got = attention(module, q, k, v, None, scaling=0.3, sliding_window=window)[0]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=_mask(seq, window), scale=0.3
    ).transpose(1, 2)
    _check(got, want, weight, (q, k, v))


def _tiny_config() -> GptOssConfig:
    conf = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    conf._attn_implementation = "eager"
    return conf


def _init(model: torch.nn.Module) -> None:
    """Random weights everywhere (GPT-OSS's sinks and experts start empty or zero)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("layer", [0, 1])
def test_a_gpt_oss_decoder_layer(layer: int) -> None:
    """A sliding (0) and a full (1) layer: ours called without a mask, eager with the explicit one;
    output and every parameter's gradient."""
    conf = _tiny_config()
    block = GptOssDecoderLayer(conf, layer).float()
    _init(block)
    rope = GptOssRotaryEmbedding(conf)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 12, 32, generator=g)
    pos = rope(x, torch.arange(12).expand(2, 12))
    window = conf.sliding_window if layer == 0 else None
    runs = []
    for impl, mask in [("eager", _additive(_mask(12, window))), (ATTENTION, None)]:
        conf._attn_implementation = impl
        block.zero_grad()
        out = block(x, attention_mask=mask, position_embeddings=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in block.named_parameters()}))
    (want, want_grads), (got, got_grads) = runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want_grads["self_attn.sinks"].abs().sum() > 0
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_gpt_oss_model_through_hf_forward() -> None:
    """HF's own forward: eager builds its masks; with ATTENTION it builds none (an unknown mask type) and
    ours keeps windows and sinks. Loss and every parameter's gradient."""
    conf = _tiny_config()
    model = GptOssForCausalLM(conf).float()
    _init(model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    runs = []
    for impl in ["eager", ATTENTION]:
        model.config._attn_implementation = impl
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
