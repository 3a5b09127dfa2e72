"""The step engine alone (no processes): loss and every unit's gradient equal HF autograd."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain.data import DataConfig, batch
from megatrain.ipc.protocol import blocks, checkpoint_host_bytes, fetch_order, forward_order, grad_order
from megatrain.model.weights import flat_unit
from megatrain.step.engine import EngineConfig, StepEngine
from tests.model_fixtures import DictSink, DictSource, spec_for, tiny_hf


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("k, last", [(1, 0), (2, 0), (3, 0), (1, 2), (2, 1)])
@pytest.mark.parametrize("chunk", [0, 1, 2])
def test_engine_matches_hf_autograd(family: str, tied: bool, k: int, last: int, chunk: int) -> None:
    """k=3 is one block (no recompute); last=2 keeps the top two layers' graphs, last=1 only the top
    one's; chunk 2 of a batch of 3 leaves an uneven last chunk."""
    model = tiny_hf(family, tied)
    spec = spec_for(model, family)
    data = DataConfig(seq_len=24, batch_size=3)
    ids, labels = batch(data, 0)
    ref_loss = model(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    ref_grads = {k_: p.grad for k_, p in model.named_parameters()}
    state = {k_: v.detach() for k_, v in model.state_dict().items()}

    n = spec.layout.num_layers
    cfg = EngineConfig(checkpoint_interval=k, last_block_layers=last, loss_chunk_tokens=10, chunk_sequences=chunk)
    engine = StepEngine(spec, cfg, torch.device("cpu"), torch.float32)
    src, sink = DictSource(spec, state, blocks=blocks(n, k, last)), DictSink()
    res = engine.step(ids, labels, src, sink)

    assert src.seen == fetch_order(blocks(n, k, last))
    assert sink.order == grad_order(n)
    assert abs(float(res.loss) - float(ref_loss.detach())) <= 1e-6 * abs(float(ref_loss.detach()))
    for unit in range(n + 2):
        want = flat_unit(spec, unit, ref_grads)
        got = sink.grads[unit][: want.numel()]
        assert torch.linalg.norm(got - want) <= 1e-5 * torch.linalg.norm(want), unit


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [0, 2])
def test_evaluate_and_predict_match_the_hf_forward(family: str, tied: bool, chunk: int) -> None:
    """Forward-only walks: the summed token loss and the labelled-token count (labels with ignored
    positions), and the greedy next token at a different position per row, equal HF's forward."""
    model = tiny_hf(family, tied).eval()
    spec = spec_for(model, family)
    ids, labels = batch(DataConfig(seq_len=24, batch_size=3), 1)
    labels[0, :10] = -100
    labels[2, 5:] = -100
    state = {k_: v.detach() for k_, v in model.state_dict().items()}
    cfg = EngineConfig(loss_chunk_tokens=7, chunk_sequences=chunk)
    engine = StepEngine(spec, cfg, torch.device("cpu"), torch.float32)
    n = spec.layout.num_layers
    src = DictSource(spec, state, forward_order(n))
    total, tokens = engine.evaluate(ids, labels, src)
    assert src.seen == forward_order(n) == [u.index for u in spec.layout.units]  # every unit once, in order
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        summed = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(1)).loss  # HF's sum
    # the labelled tokens: what HF divides its summed loss by
    assert int(tokens) == round(float(summed) / float(out.loss))
    assert abs(float(total) - float(summed)) <= 1e-6 * float(summed)
    pos = torch.tensor([3, 23, 10])
    got = engine.predict(ids, pos, DictSource(spec, state, forward_order(n)))
    assert got.tolist() == out.logits[torch.arange(3), pos].argmax(-1).tolist()


def test_blocks_put_the_short_one_first() -> None:
    assert blocks(8, 3) == [[1, 2], [3, 4, 5], [6, 7, 8]]
    assert blocks(8, 4) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert blocks(3, 5) == [[1, 2, 3]]
    assert fetch_order(blocks(3, 2)) == [0, 1, 2, 3, 4, 1]


def test_last_block_takes_its_own_size() -> None:
    assert blocks(8, 2, 6) == [[1, 2], [3, 4, 5, 6, 7, 8]]
    assert blocks(8, 3, 4) == [[1], [2, 3, 4], [5, 6, 7, 8]]
    assert blocks(8, 2, 1) == [[1], [2, 3], [4, 5], [6, 7], [8]]
    assert blocks(3, 1, 9) == [[1, 2, 3]]  # capped at the layer count: nothing recomputed
    assert blocks(8, 4, 0) == blocks(8, 4, 4)
    assert fetch_order(blocks(4, 1, 2)) == [0, 1, 2, 3, 4, 5, 2, 1]


def test_checkpoint_host_bytes_follow_blocks_and_device() -> None:
    spec = spec_for(tiny_hf("llama", tied=False, layers=5), "llama")
    hidden = spec.hf_config.hidden_size
    cuda = EngineConfig(device="cuda", compute_dtype="bf16", checkpoint_interval=2)
    assert checkpoint_host_bytes(spec, cuda, 3, 16) == 2 * 3 * 16 * hidden * 2  # blocks [1], [2,3], [4,5]
    assert checkpoint_host_bytes(spec, dataclasses.replace(cuda, offload_checkpoints=False), 3, 16) == 0
    assert checkpoint_host_bytes(spec, dataclasses.replace(cuda, device="cpu"), 3, 16) == 0
    assert checkpoint_host_bytes(spec, dataclasses.replace(cuda, checkpoint_interval=5), 3, 16) == 0
    top4 = dataclasses.replace(cuda, last_block_layers=4)  # blocks [1], [2,3,4,5]
    assert checkpoint_host_bytes(spec, top4, 3, 16) == 1 * 3 * 16 * hidden * 2
