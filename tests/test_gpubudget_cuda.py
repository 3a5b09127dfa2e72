"""engine.gpu_memory_gib on a GPU (skipped without one; MEGATRAIN_TEST_CUDA=1 pytest -m cuda): the cap refuses
what lies beyond the budget, and a run under a budget smaller than what it takes on the whole GPU trains within
it, its CUDA context included. In-process: the executor's allocations are this process's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatrain.launch.config.tree import load_config
from megatrain.launch.run.driver import Trainer
from megatrain.memory import autosize
from megatrain.memory import budget as gpubudget
from megatrain.model.spec import build_spec
from megatrain.step.engine import resolve_engine
from tests.harness import NEEDS_CUDA

pytestmark = NEEDS_CUDA
GIB = 2**30
DEVICE = torch.device("cuda", 0)
MODEL = dict(  # 0.16B parameters: about 1.3 GiB of activations per layer at 8x4096 tokens
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    use_sliding_window=False,
)
BATCH, SEQ = 8, 4096


@pytest.fixture
def uncapped():
    """The GPU with nothing of this process's cached, and its cap lifted after the test whatever happens."""
    torch.cuda.synchronize(DEVICE)
    torch.cuda.empty_cache()
    yield
    torch.cuda.empty_cache()
    gpubudget.cap_device(DEVICE, None)


def test_the_cap_refuses_an_allocation_past_the_budget(uncapped) -> None:
    cap = gpubudget.cap_device(DEVICE, 2 * GIB)
    assert cap is not None and 0 < cap.context <= gpubudget.MAX_CONTEXT_BYTES and cap.room < 2 * GIB
    half = torch.empty(cap.room // 2, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(cap.room, dtype=torch.uint8, device=DEVICE)
    del half
    torch.cuda.empty_cache()
    gpubudget.cap_device(DEVICE, None)
    torch.empty(3 * GIB, dtype=torch.uint8, device=DEVICE)  # lifted


def test_a_run_under_a_budget_stays_within_it(tmp_path: Path, uncapped) -> None:
    """The budget: a GiB over the least the plan computes, well under what the sizes take on the whole GPU.
    The run picks smaller sizes, trains, and its CUDA context plus the most the allocator reserved stay
    within the budget (what nvidia-smi would show for the process)."""
    overrides = [
        "model.family=qwen2",
        f"model.hf={json.dumps(MODEL)}",
        f"data.seq_len={SEQ}",
        f"data.batch_size={BATCH}",
        "train.steps=3",
        f"train.output_dir={tmp_path / 'run'}",
        "launch.runner=inprocess",
        "engine.device=cuda",
    ]
    cfg = load_config(None, overrides)
    spec, engine = build_spec(cfg.model, cfg.optim.no_decay_1d), resolve_engine(cfg.engine, True)
    free, total = torch.cuda.mem_get_info(DEVICE)
    context = total - free - torch.cuda.memory_reserved(DEVICE)
    whole, _ = autosize.choose(spec, engine, BATCH, SEQ, free, cfg.optim.clips)
    least = gpubudget.least_room(spec, engine, BATCH, SEQ, cfg.optim.clips)
    budget = math.ceil((least + gpubudget.CONTEXT_BYTES) / GIB) + 1
    if gpubudget.peak_bytes(spec, engine, BATCH, SEQ, whole) < budget * GIB:
        pytest.skip(f"this GPU's free memory ({free / GIB:.1f} GiB) leaves the run no larger than the budget")
    torch.cuda.reset_peak_memory_stats(DEVICE)
    summary = Trainer(load_config(None, [*overrides, f"engine.gpu_memory_gib={budget}"])).run()
    assert len(summary.metrics) == 3 and all(math.isfinite(r["loss"]) for r in summary.metrics)
    reserved = torch.cuda.max_memory_reserved(DEVICE)
    assert context + reserved <= budget * GIB, (
        f"context {context / GIB:.2f} + reserved {reserved / GIB:.2f} GiB over the {budget} GiB budget"
    )
    assert max(r["gpu_peak_bytes"] for r in summary.metrics) <= budget * GIB - context
