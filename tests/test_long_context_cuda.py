"""Long-context paths on a GPU (skipped without one): token tiles and sliding windows in bf16 against the
untiled / HF-masked computation, and the memory a tile saves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.data import DataConfig, batch
from megatrain.ipc.protocol import blocks
from megatrain.layers.attention import windowed_attention
from megatrain.model.spec import family_classes
from megatrain.model.weights import flat_unit
from megatrain.step.engine import EngineConfig, StepEngine
from tests.harness import NEEDS_CUDA
from tests.model_fixtures import DictSink, DictSource, hf_one_by_one, packed_batch, spec_for, tiny_hf

pytestmark = NEEDS_CUDA

WIDE = dict(
    hidden_size=512,
    intermediate_size=2816,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=16384,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    use_sliding_window=False,
)


class CudaSource(DictSource):
    def fetch(self, unit: int) -> torch.Tensor:
        return super().fetch(unit).cuda().to(torch.bfloat16)


def _step(model: torch.nn.Module, tile: int, seq: int) -> tuple[float, dict[int, torch.Tensor], int]:
    spec = spec_for(model, "qwen2")
    ids, labels = batch(DataConfig(seq_len=seq, batch_size=1), 0)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = EngineConfig(
        device="cuda",
        compute_dtype="bf16",
        checkpoint_interval=1,
        last_block_layers=1,
        loss_chunk_tokens=2048,
        token_tile=tile,
        offload_checkpoints=False,
    )
    engine = StepEngine(spec, cfg, torch.device("cuda"), torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sink = DictSink()
    res = engine.step(ids, labels, CudaSource(spec, state, blocks=blocks(2, 1, 1)), sink)
    torch.cuda.synchronize()
    return float(res.loss), sink.grads, torch.cuda.max_memory_allocated() - base


def test_tiles_give_the_untiled_step_in_bf16_with_less_memory() -> None:
    """16K tokens through two Qwen2-shaped layers, MLP tiles of 3000 tokens (not dividing them): the loss
    and every unit's gradient agree with the untiled step to bf16 precision, and the step's peak is lower."""
    conf_cls, model_cls = family_classes("qwen2")
    conf = conf_cls(**WIDE)
    conf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_cls(conf).float()
    loss, grads, peak = _step(model, 0, 16384)
    t_loss, t_grads, t_peak = _step(model, 3000, 16384)
    assert abs(t_loss - loss) <= 2e-3 * abs(loss)
    for unit, g in grads.items():
        rel = torch.linalg.norm(t_grads[unit].float() - g.float()) / torch.linalg.norm(g.float())
        assert rel <= 2e-2, (unit, float(rel))
    assert t_peak < 0.8 * peak, (t_peak, peak)


@pytest.mark.parametrize("window", [1024, 3000])
def test_windowed_attention_on_the_gpu_is_masked_attention(window: int) -> None:
    """bf16, 8192 tokens, grouped-query heads: the tiled windows against SDPA with the whole mask,
    forward and backward."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 8192, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 8192, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 8192, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    qi, kj = torch.arange(8192, device="cuda").unsqueeze(1), torch.arange(8192, device="cuda").unsqueeze(0)
    mask = (kj <= qi) & (kj > qi - window)
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask
    ).transpose(1, 2)
    got = windowed_attention(q, k, v, window, None)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    go = torch.randn_like(got)
    grads = torch.autograd.grad(got, [q, k, v], go)
    want_grads = torch.autograd.grad(want, [q, k, v], go)
    for a, b in zip(grads, want_grads):
        rel = torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float())
        assert rel <= 2e-2, float(rel)


@pytest.mark.parametrize("tile", [0, 7])
def test_packed_documents_on_the_gpu_are_the_documents_one_by_one(tile: int) -> None:
    """bf16 on the GPU (ids, labels and positions uploaded together; attention per document in the GPU's
    kernels) against the fp32 HF model run on each document alone, untiled and in token tiles."""
    model = tiny_hf("llama", tied=False)
    spec = spec_for(model, "llama")
    ids, labels, pos = packed_batch()
    ref, ref_grads = hf_one_by_one(model, ids, labels)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = EngineConfig(checkpoint_interval=2, last_block_layers=1, loss_chunk_tokens=10, token_tile=tile)
    sink = DictSink()
    engine = StepEngine(spec, cfg, torch.device("cuda"), torch.bfloat16)
    res = engine.step(ids, labels, CudaSource(spec, state, blocks=blocks(3, 2, 1)), sink, positions=pos)
    assert abs(float(res.loss) - float(ref)) <= 1e-2 * abs(float(ref))
    for unit in range(spec.layout.num_layers + 2):
        want = flat_unit(spec, unit, ref_grads)
        got = sink.grads[unit][: want.numel()].float().cpu()
        assert torch.linalg.norm(got - want) <= 5e-2 * torch.linalg.norm(want), unit
