"""Sliding-window attention (megatrain/layers/attention.py): the engine against the HF model, which builds its own
sliding-window masks, for Mistral and Qwen2 (including Qwen2's full-attention layers below
max_window_layers), tiled and untiled, and the whole pipeline against the plain-PyTorch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.data import DataConfig, batch
from megatrain.ipc.protocol import blocks
from megatrain.launch.cli.fidelity import compare
from megatrain.layers.attention import windowed_attention
from megatrain.model.spec import family_classes
from megatrain.model.weights import flat_unit
from megatrain.step.engine import EngineConfig, StepEngine
from tests.harness import TINY, check, tiny_config
from tests.model_fixtures import DictSink, DictSource, spec_for, windowed_hf


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("seq, window", [(24, 5), (24, 8), (7, 3), (9, 1)])
def test_windowed_attention_is_masked_attention(seq: int, window: int, groups: int) -> None:
    """Against SDPA with the whole [seq, seq] sliding-window mask (HF's rule: i - W < j <= i)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, seq, 8, generator=g)
    k, v = torch.randn(2, 6 // groups, seq, 8, generator=g), torch.randn(2, 6 // groups, seq, 8, generator=g)
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    mask = (j <= i) & (j > i - window)
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(windowed_attention(q, k, v, window, None), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family, max_window_layers", [("mistral", 0), ("qwen2", 0), ("qwen2", 2)])
@pytest.mark.parametrize("tile", [0, 7])
def test_the_engine_attends_within_the_window(family: str, max_window_layers: int, tile: int) -> None:
    """A window of 5 under 24-token sequences: loss and every unit's gradient are the HF model's (its own
    masks); Qwen2 with max_window_layers 2 has full attention in layers 0-1 and windows above."""
    model = windowed_hf(family, 5, max_window_layers=max_window_layers)
    spec = spec_for(model, family)
    ids, labels = batch(DataConfig(seq_len=24, batch_size=3), 0)
    ref = model(input_ids=ids, labels=labels).loss
    ref.backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    # The same model with the window widened to the sequence is another model: the test can fail.
    wide = windowed_hf(family, 24, max_window_layers=max_window_layers)
    wide.load_state_dict(model.state_dict())
    assert abs(float(wide(input_ids=ids, labels=labels).loss.detach()) - float(ref.detach())) > 1e-4

    state = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = EngineConfig(checkpoint_interval=2, last_block_layers=1, loss_chunk_tokens=10, token_tile=tile)
    sink = DictSink()
    res = StepEngine(spec, cfg, torch.device("cpu"), torch.float32).step(
        ids, labels, DictSource(spec, state, blocks=blocks(3, 2, 1)), sink
    )
    assert abs(float(res.loss) - float(ref)) <= 1e-6 * abs(float(ref))
    for unit in range(spec.layout.num_layers + 2):
        want = flat_unit(spec, unit, ref_grads)
        got = sink.grads[unit][: want.numel()]
        assert torch.linalg.norm(got - want) <= 1e-5 * torch.linalg.norm(want), unit


@pytest.mark.parametrize(
    "family, extra",
    [
        ("mistral", ["model.hf.sliding_window=6"]),
        ("qwen2", ["model.hf.sliding_window=6", "model.hf.use_sliding_window=true", "model.hf.max_window_layers=1"]),
    ],
)
def test_sliding_window_models_train_and_match_plain_pytorch(tmp_path, family: str, extra: list[str]) -> None:
    """A window shorter than data.seq_len trains (it was refused) and ten steps match the HF model +
    clip_grad_norm_ + torch.optim.AdamW to 1e-5."""
    check(compare(tiny_config(family, False, 2, tmp_path, extra=extra), tmp_path), False)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_long_context_rope_settings_are_hf_s(family: str, rope: dict) -> None:
    """rope_theta and rope_scaling (linear, dynamic NTK, YaRN) from the config: the engine's loss and
    gradients are the HF model's at a length past the original context (the rotary module is HF's own)."""
    conf_cls, model_cls = family_classes(family)
    conf = conf_cls(
        **{
            **TINY,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
            "rope_scaling": {**rope, "rope_theta": 5e5},
        }
    )
    conf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_cls(conf).float()
    spec = spec_for(model, family)
    ids, labels = batch(DataConfig(seq_len=96, batch_size=2), 0)
    ref = model(input_ids=ids, labels=labels).loss
    ref.backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    sink = DictSink()
    res = StepEngine(
        spec, EngineConfig(checkpoint_interval=2, loss_chunk_tokens=50), torch.device("cpu"), torch.float32
    ).step(
        ids,
        labels,
        DictSource(spec, {k: v.detach() for k, v in model.state_dict().items()}, blocks=blocks(3, 2, 0)),
        sink,
    )
    assert abs(float(res.loss) - float(ref.detach())) <= 1e-6 * abs(float(ref.detach()))
    for unit in range(spec.layout.num_layers + 2):
        want = flat_unit(spec, unit, ref_grads)
        assert torch.linalg.norm(sink.grads[unit][: want.numel()] - want) <= 1e-5 * torch.linalg.norm(want), unit
