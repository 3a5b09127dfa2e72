"""The executor's warm-up (megatrain/step/warmup.py): at the run's shapes and settings it runs the kernels a step
runs, on throwaway weights, and leaves nothing behind in the engine."""

from __future__ import annotations

import pytest
import torch

from megatrain.data import DataConfig, batch
from megatrain.ipc.protocol import blocks
from megatrain.step.engine import EngineConfig, StepEngine
from megatrain.step.warmup import warm_up
from tests.model_fixtures import DictSink, DictSource, spec_for, tiny_hf


@pytest.mark.parametrize("tied, tile, lean", [(True, 0, 0), (False, 7, 1)])
def test_a_warm_up_runs_the_step_kernels_and_changes_no_step(tied: bool, tile: int, lean: int) -> None:
    model = tiny_hf("llama", tied)
    spec = spec_for(model, "llama")
    cfg = EngineConfig(
        checkpoint_interval=2, last_block_layers=2, loss_chunk_tokens=10, token_tile=tile, lean_layers=lean
    )
    state = {k: v.detach() for k, v in model.state_dict().items()}
    ids, labels = batch(DataConfig(seq_len=24, batch_size=3), 0)

    def step(engine: StepEngine) -> tuple[float, dict]:
        sink = DictSink()
        res = engine.step(ids, labels, DictSource(spec, state, blocks=blocks(3, 2, 2)), sink)
        return float(res.loss), sink.grads

    cold = StepEngine(spec, cfg, torch.device("cpu"), torch.float32)
    want_loss, want = step(cold)
    warm = StepEngine(spec, cfg, torch.device("cpu"), torch.float32)
    calls: list[tuple] = []
    layer, head = warm.t.layer, warm.t.head

    def counted(fn, name):
        def call(*args, **kw):
            out = fn(*args, **kw)
            calls.append((name, tuple(out.shape), kw.get("lean", False)))
            return out

        return call

    warm.t.layer, warm.t.head = counted(layer, "layer"), counted(head, "head")
    warm_up(warm, 3, 24)
    assert ("layer", (3, 24, 32), False) in calls and ("head", (10, 256), False) in calls
    assert (("layer", (3, 24, 32), True) in calls) == bool(lean)
    warm.t.layer, warm.t.head = layer, head
    loss, got = step(warm)
    assert loss == want_loss and all(torch.equal(got[u], want[u]) for u in want)
