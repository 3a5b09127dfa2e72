"""Token-tiled layers (megatrain/step/tiling.py): the HF layer's output and gradients, and the whole pipeline
against the plain-PyTorch reference, with tiles that do not divide the tokens."""

from __future__ import annotations

import pytest
import torch

from megatrain.data import DataConfig, batch
from megatrain.errors import ConfigError
from megatrain.ipc.protocol import blocks
from megatrain.launch.cli.fidelity import compare
from megatrain.step.engine import EngineConfig, StepEngine
from megatrain.step.tiling import tiled_layer
from tests.harness import check, tiny_config
from tests.model_fixtures import DictSink, DictSource, spec_for, tiny_hf


def _layer_run(family: str, tile: int, lean: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = tiny_hf(family, tied=False, layers=1)
    layer = model.model.layers[0]
    x = torch.randn(3, 13, model.config.hidden_size, requires_grad=True)
    pos_ids = torch.arange(13).unsqueeze(0)
    kwargs = {
        "position_embeddings": model.model.rotary_emb(x, pos_ids),
        "position_ids": pos_ids,
        "attention_mask": None,
    }
    params = dict(layer.named_parameters())
    if tile:
        from megatrain.step.lean import lean_call

        out = tiled_layer(layer, params, x, tile, kwargs, lean_call if lean else None)
    else:
        out = layer(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, [x, *params.values()], g)
    return out.detach(), list(grads)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tile, lean", [(5, False), (16, True), (1, False), (39, False)])
def test_a_tiled_layer_is_the_hf_layer(family: str, tile: int, lean: bool) -> None:
    """39 tokens in tiles of 5, 16 (lean attention half), 1, and all 39 at once: the output and the
    gradients of the input and of every parameter are the HF layer's, to the order of an fp32 sum."""
    out, grads = _layer_run(family, 0, False)
    t_out, t_grads = _layer_run(family, tile, lean)
    torch.testing.assert_close(t_out, out, rtol=1e-6, atol=1e-6)
    for a, b in zip(t_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_tiled_layer_keeps_only_its_input_for_the_mlp_half() -> None:
    """The tiled half saves x and the parameters for its backward, nothing intermediate_size wide: the
    largest tensor autograd keeps is tokens x hidden, where the untiled layer keeps tokens x intermediate."""
    model = tiny_hf("llama", tied=False, layers=1)
    layer, hf = model.model.layers[0], model.config
    x = torch.randn(1, 64, hf.hidden_size, requires_grad=True)
    pos_ids = torch.arange(64).unsqueeze(0)
    kwargs = {
        "position_embeddings": model.model.rotary_emb(x, pos_ids),
        "position_ids": pos_ids,
        "attention_mask": None,
    }
    params = dict(layer.named_parameters())

    def activations(call) -> set[int]:
        seen: set[tuple] = set()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.add(tuple(t.shape)) or t, lambda t: t):
            call()
        return {s[-1] for s in seen if len(s) >= 2 and s[-2] == 64}

    assert hf.intermediate_size in activations(lambda: layer(x, **kwargs))
    assert hf.intermediate_size not in activations(lambda: tiled_layer(layer, params, x, 8, kwargs))


def _step(family: str, tile: int, last: int, lean: int, chunk: int):
    model = tiny_hf(family, family == "llama", layers=4)
    spec = spec_for(model, family)
    ids, labels = batch(DataConfig(seq_len=24, batch_size=3), 0)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = EngineConfig(
        checkpoint_interval=2,
        last_block_layers=last,
        lean_layers=lean,
        loss_chunk_tokens=10,
        chunk_sequences=chunk,
        token_tile=tile,
    )
    sink = DictSink()
    res = StepEngine(spec, cfg, torch.device("cpu"), torch.float32).step(
        ids, labels, DictSource(spec, state, blocks=blocks(4, 2, last)), sink
    )
    return res.loss, sink.grads


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tile, last, lean, chunk", [(7, 2, 0, 0), (50, 3, 2, 0), (11, 2, 0, 2)])
def test_a_tiled_step_gives_the_untiled_step(family: str, tile: int, last: int, lean: int, chunk: int) -> None:
    """Through the engine (recomputed blocks, the last block, lean layers, sequence chunks): the loss and
    every unit's gradient are the untiled step's."""
    loss, grads = _step(family, 0, last, lean, chunk)
    t_loss, t_grads = _step(family, tile, last, lean, chunk)
    torch.testing.assert_close(t_loss, loss, rtol=1e-6, atol=0)
    assert grads.keys() == t_grads.keys()
    for unit, g in grads.items():
        torch.testing.assert_close(t_grads[unit], g, rtol=1e-5, atol=1e-6, msg=f"unit {unit}")


def test_a_tile_for_a_layer_of_another_shape_is_refused() -> None:
    model = tiny_hf("llama", tied=False, layers=2)
    spec = spec_for(model, "llama")
    engine = StepEngine(spec, EngineConfig(token_tile=0), torch.device("cpu"), torch.float32)
    del engine.t.layers[1].post_attention_layernorm
    with pytest.raises(ConfigError, match="engine.token_tile"):
        engine.t.use_tiles(8)


@pytest.mark.parametrize("family,tied,k", [("qwen2", False, 2), ("mistral", True, 1)])
def test_tiled_layers_match_plain_pytorch(tmp_path, family: str, tied: bool, k: int) -> None:
    """The actor pipeline with tiles of 7 tokens (not dividing the batch's tokens) and clipping active:
    ten steps match the HF model + clip_grad_norm_ + torch.optim.AdamW to 1e-5."""
    check(compare(tiny_config(family, tied, k, tmp_path, extra=["engine.token_tile=7"]), tmp_path), tied)
