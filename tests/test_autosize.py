"""The `auto` engine sizes (megatrain/memory/autosize.py): the rule, on the Qwen2.5-7B layer shape it was
calibrated on, and explicit values winning over it."""

from __future__ import annotations

import dataclasses

import pytest

from megatrain.ipc.protocol import checkpoint_host_bytes
from megatrain.launch.config.tree import load_config
from megatrain.memory import autosize
from megatrain.model.spec import ModelConfig, build_spec
from megatrain.step.blocks import blocks
from megatrain.step.engine import FIXED_SIZES, EngineConfig, resolve_engine
from tests.harness import QWEN7B

GIB = 2**30


@pytest.fixture(scope="module")
def spec8():
    return build_spec(ModelConfig(family="qwen2", hf={**QWEN7B, "num_hidden_layers": 8}))


def cuda_cfg(**kw) -> EngineConfig:
    return resolve_engine(EngineConfig(**kw), cuda=True)


def test_the_cpu_device_keeps_the_fixed_defaults_whatever_the_shape_and_explicit_values(spec8) -> None:
    """No GPU to size for: the same sizes for every batch and sequence (the loss in chunks of 2048 tokens,
    as docs/configuration.md says), an explicit value kept."""
    cpu = resolve_engine(EngineConfig(), cuda=False)
    for batch, seq in ((4, 128), (16, 4096), (1, 262144)):
        sizes, why = autosize.choose(spec8, cpu, batch, seq, None, clip=True)
        assert sizes == autosize.Sizes(**FIXED_SIZES) and "CPU" in why
    assert sizes.loss_chunk_tokens == 2048
    given = resolve_engine(EngineConfig(checkpoint_interval=3), cuda=False)
    assert autosize.choose(spec8, given, 4, 128, None, clip=True)[0].checkpoint_interval == 3


SHAPES = [(8, 16, 4096), (28, 16, 4096), (8, 158, 1024), (28, 1, 131072)]  # (layers, batch, seq)
FREE_GIB = range(24, 145, 8)


@pytest.mark.parametrize("layers,batch,seq", SHAPES, ids=str)
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "no-clip"])
def test_every_plan_fits_the_memory_it_was_given_and_more_memory_never_takes_from_it(layers, batch, seq, clip) -> None:
    """Over GPUs of 24 to 144 GiB: what the plan puts on the GPU fits the budget the rule allows (the largest
    unit's weights and gradient are what the margin covers); more memory never gives smaller loss chunks,
    nor, among untiled plans, a smaller last block."""
    spec = build_spec(ModelConfig(family="qwen2", hf={**QWEN7B, "num_hidden_layers": layers}))
    last, loss = 0, 0
    for gib in FREE_GIB:
        sizes, why = autosize.choose(spec, cuda_cfg(), batch, seq, gib * GIB, clip=clip)
        terms = autosize.gpu_terms(spec, autosize.apply(cuda_cfg(), sizes), batch, seq, sizes)
        assert terms.pop("largest unit's weights and fp32 gradient") > 0
        assert sum(terms.values()) <= gib * GIB * autosize.MARGIN, (gib, sizes, terms)
        assert 1 <= sizes.last_block_layers <= layers and 0 <= sizes.lean_layers <= sizes.last_block_layers
        assert sizes.loss_chunk_tokens >= loss, (gib, sizes, why)
        if not sizes.token_tile:
            assert sizes.last_block_layers >= last, (gib, sizes, why)
            last = sizes.last_block_layers
        loss = sizes.loss_chunk_tokens


def test_an_h200_gets_the_measured_headline_shape(spec8) -> None:
    """138 GiB free, 16x4096 tokens: 14.6 GiB per layer measured (the hand-picked 28-layer headline, 6
    layers in the last block, peaked at 109.5 GiB; 7 are predicted at about 122 GiB, within 92 % of the
    free memory), K 2, the whole batch, 8192-token loss chunks. With lean layers (7.4 GiB each) all 8 fit,
    2 of them lean; without, 7 as measured."""
    sizes, why = autosize.choose(spec8, cuda_cfg(), 16, 4096, 138 * GIB, clip=True)
    assert sizes == autosize.Sizes(2, 8, 0, 8192, 2, False), why
    assert autosize.choose(spec8, cuda_cfg(lean_layers=0), 16, 4096, 138 * GIB, clip=True)[0] == autosize.Sizes(
        2, 7, 0, 8192, 0, False
    )
    assert abs(autosize.layer_activation_bytes(spec8, 16 * 4096, 2) / GIB - 14.6) < 0.2
    assert abs(autosize.lean_bytes(spec8, 16 * 4096, 2) / GIB - 7.4) < 0.1


def test_lean_layers_let_the_last_block_of_28_layers_double() -> None:
    """7.6B at 16x4096 on an H200: 13 layers in the last block (1 whole, 12 lean) where 7 whole fit, so 15
    layers are recomputed instead of 21, in blocks of 7 (the room the last block leaves), whose 3 checkpoints
    stay on the GPU; the plan stays within the budget the rule allows."""
    spec = build_spec(ModelConfig(family="qwen2", hf={**QWEN7B, "num_hidden_layers": 28}))
    free = int(139.3 * GIB)
    sizes, why = autosize.choose(spec, cuda_cfg(), 16, 4096, free, clip=False)
    assert sizes == autosize.Sizes(7, 13, 0, 8192, 12, False) and "a lean one's 7.38" in why, why
    terms = autosize.gpu_terms(spec, autosize.apply(cuda_cfg(), sizes), 16, 4096, sizes)
    margin_covers = terms.pop("largest unit's weights and fp32 gradient")
    assert margin_covers > 0 and sum(terms.values()) <= free * autosize.MARGIN
    assert terms["12 lean layers (65536 tokens each, weights too)"] == 12 * autosize.lean_bytes(spec, 65536, 2)
    # One more layer in the block would not fit even all lean.
    assert not autosize._fits(
        14, 14, (autosize.layer_activation_bytes(spec, 65536, 2), autosize.lean_bytes(spec, 65536, 2), int(107.7 * GIB))
    )


def test_an_explicit_last_block_gets_the_fewest_lean_layers_that_fit(spec8) -> None:
    """A given last block: no lean layer where it fits whole, the fewest that make it fit, all of them where
    nothing fits; explicit lean layers cap the block the rule picks."""
    free = int(139.3 * GIB)
    assert autosize.choose(spec8, cuda_cfg(last_block_layers=7), 16, 4096, free, clip=True)[0].lean_layers == 0
    assert autosize.choose(spec8, cuda_cfg(last_block_layers=8), 16, 4096, free, clip=True)[0].lean_layers == 2
    assert autosize.choose(spec8, cuda_cfg(last_block_layers=8), 16, 4096, 60 * GIB, clip=True)[0].lean_layers == 8
    sizes, _ = autosize.choose(spec8, cuda_cfg(lean_layers=1), 16, 4096, free, clip=True)
    assert (sizes.last_block_layers, sizes.lean_layers) == (7, 1)
    chunked = cuda_cfg(last_block_layers=8, chunk_sequences=4)  # 4 chunks: 8 whole layers of 16k tokens fit
    assert autosize.choose(spec8, chunked, 16, 4096, free, clip=True)[0].lean_layers == 0


def test_the_papers_batch_runs_every_layer_in_the_last_block_in_chunks_with_clipping(spec8) -> None:
    """158x1024 tokens (36 GiB per layer): the whole batch holds 2 layers (measured at 94.6 GiB, 5.87 s on an
    H200); with clipping, 4 chunks of 40 sequences hold all 8 (3 of 53 would not): measured 103.4 GiB, 5.32 s."""
    sizes, why = autosize.choose(spec8, cuda_cfg(), 158, 1024, int(139.3 * GIB), clip=True)
    assert sizes == autosize.Sizes(2, 8, 40, 8192, 0, False) and "chunks of 40" in why, why
    budget = 139.3 * GIB * autosize.MARGIN
    assert 8 * autosize.layer_activation_bytes(spec8, 40 * 1024, 2) + autosize.sum_bytes(spec8, 8) < budget


def test_without_clipping_the_papers_batch_keeps_the_whole_batch(spec8) -> None:
    """Without clipping each layer's update overlaps the backward, which chunking every layer would take away;
    lean layers take the last block from 2 layers to 4 (3 of them lean)."""
    sizes, _ = autosize.choose(spec8, cuda_cfg(), 158, 1024, int(139.3 * GIB), clip=False)
    assert sizes == autosize.Sizes(2, 4, 0, 8192, 3, False)
    sizes, _ = autosize.choose(spec8, cuda_cfg(lean_layers=0), 158, 1024, int(139.3 * GIB), clip=False)
    assert sizes == autosize.Sizes(2, 2, 0, 8192, 0, False)


def test_chunking_is_left_out_where_it_saves_little_or_its_chunks_would_be_small(spec8) -> None:
    """16x4096 keeps 7 of 8 layers whole (one layer's recompute is not worth the chunks); an explicit last
    block or chunk size leaves the rule alone; a GPU that would need sub-32k-token chunks keeps the recompute."""
    assert autosize.choose(spec8, cuda_cfg(), 16, 4096, int(139.3 * GIB), clip=True)[0].chunk_sequences == 0
    assert autosize.choose(spec8, cuda_cfg(last_block_layers=2), 158, 1024, int(139.3 * GIB), clip=True)[
        0
    ] == autosize.Sizes(2, 2, 0, 8192, 0, False)
    sizes, _ = autosize.choose(spec8, cuda_cfg(), 16, 4096, 60 * GIB, clip=True)
    assert sizes.chunk_sequences == 0 and sizes.last_block_layers < 8


def test_room_for_every_layer_means_no_recompute(spec8) -> None:
    sizes, _ = autosize.choose(spec8, cuda_cfg(), 2, 1024, 138 * GIB, clip=True)
    assert sizes.last_block_layers == 8 and sizes.chunk_sequences == 0


def test_a_small_gpu_chunks_the_batch_and_the_loss(spec8) -> None:
    """Less than one layer's activations free: the last block is one layer, K 1, the batch in chunks
    that fit, and smaller loss chunks."""
    sizes, _ = autosize.choose(spec8, cuda_cfg(), 16, 4096, 20 * GIB, clip=True)
    assert sizes.checkpoint_interval == 1 and sizes.last_block_layers == 1
    assert 1 <= sizes.chunk_sequences < 16 and sizes.loss_chunk_tokens < 8192
    assert sizes.lean_layers == 0  # the chunks are what make it fit
    per_seq = autosize.layer_activation_bytes(spec8, 4096, 2)
    assert sizes.chunk_sequences * per_seq <= 20 * GIB * autosize.MARGIN


def test_explicit_values_win(spec8) -> None:
    cfg = cuda_cfg(checkpoint_interval=3, loss_chunk_tokens=1000)
    sizes, _ = autosize.choose(spec8, cfg, 16, 4096, 138 * GIB, clip=True)
    assert sizes.checkpoint_interval == 3 and sizes.loss_chunk_tokens == 1000 and sizes.last_block_layers == 8
    resolved = autosize.apply(cfg, sizes)
    assert dataclasses.asdict(sizes).items() <= dataclasses.asdict(resolved).items()


def test_auto_is_the_default_and_a_bad_value_names_the_key() -> None:
    cfg = load_config(None, [])
    assert cfg.engine.checkpoint_interval == cfg.engine.last_block_layers == "auto"
    assert load_config(None, ["engine.checkpoint_interval=3"]).engine.checkpoint_interval == 3
    with pytest.raises(Exception, match="engine.chunk_sequences"):
        load_config(None, ["engine.chunk_sequences=lots"])


def test_recompute_blocks_take_the_room_the_last_block_leaves_and_keep_their_checkpoints_on_the_gpu() -> None:
    """7.6B at 16x4096 on an H100 (78.6 GiB free): K as large as the room holds (3 whole layers with their
    weights), so 22 recomputed layers keep 8 checkpoints (3.5 GiB), on the GPU; with K 2 they would be 11.
    Where the checkpoints would take more than an eighth of the room they go to pinned host memory, and an
    explicit choice is kept (on the GPU, the last block makes room for them)."""
    spec = build_spec(ModelConfig(family="qwen2", hf={**QWEN7B, "num_hidden_layers": 28}))
    free = int(78.6 * GIB)
    sizes, why = autosize.choose(spec, cuda_cfg(), 16, 4096, free, clip=True)
    assert (sizes.checkpoint_interval, sizes.last_block_layers, sizes.offload_checkpoints) == (3, 6, False), why
    assert "8 on the GPU" in why
    terms = autosize.gpu_terms(spec, autosize.apply(cuda_cfg(), sizes), 16, 4096, sizes)
    assert terms["activation checkpoints on the GPU (8)"] == 8 * 65536 * 3584 * 2
    terms.pop("largest unit's weights and fp32 gradient")
    assert sum(terms.values()) <= free * autosize.MARGIN
    deep = build_spec(ModelConfig(family="qwen2", hf={**QWEN7B, "num_hidden_layers": 200}))
    sizes, why = autosize.choose(deep, cuda_cfg(), 16, 4096, free, clip=True)
    assert sizes.offload_checkpoints and "in pinned host RAM" in why, why
    pinned, _ = autosize.choose(spec, cuda_cfg(offload_checkpoints=True), 16, 4096, free, clip=True)
    assert pinned.offload_checkpoints and pinned.last_block_layers >= sizes.last_block_layers
    kept, _ = autosize.choose(deep, cuda_cfg(offload_checkpoints=False), 16, 4096, free, clip=True)
    assert not kept.offload_checkpoints


def test_checkpoints_the_host_cannot_hold_stay_on_the_gpu() -> None:
    """7.6B at 512K tokens (a checkpoint is 3.5 GiB): with room on the host for all of the plan's checkpoints
    but one, that one stays on the GPU, whose budget makes room for it (which may take a layer from the last
    block, and so add checkpoints, also on the GPU); with room for all, all go to the host; with room for
    none and a GPU that cannot hold them, all go to the host (the store owner then refuses, with the
    numbers); an explicit count is kept."""
    spec = build_spec(ModelConfig(family="qwen2", hf={**QWEN7B, "num_hidden_layers": 28}))
    each, free, seq = 524288 * 3584 * 2, int(139.3 * GIB), 524288
    everything, why = autosize.choose(spec, cuda_cfg(), 1, seq, free, clip=False, host_room=40 * each)
    saved = len(blocks(28, everything.checkpoint_interval, everything.last_block_layers)) - 1
    assert everything.offload_checkpoints is True and f"{saved} in pinned host RAM" in why, why
    sizes, why = autosize.choose(spec, cuda_cfg(), 1, seq, free, clip=False, host_room=(saved - 1) * each + 100)
    on_gpu = len(blocks(28, sizes.checkpoint_interval, sizes.last_block_layers)) - 1 - (saved - 1)
    assert on_gpu >= 1 and sizes.offload_checkpoints == saved - 1, why
    assert f"{saved - 1} in pinned host RAM (as many as the host holds), {on_gpu} on" in why, why
    engine = autosize.apply(cuda_cfg(), sizes)
    terms = autosize.gpu_terms(spec, engine, 1, seq, sizes)
    assert terms[f"activation checkpoints on the GPU ({on_gpu})"] == on_gpu * each
    terms.pop("largest unit's weights and fp32 gradient")
    assert sum(terms.values()) <= free * autosize.MARGIN
    assert checkpoint_host_bytes(spec, engine, 1, seq) == (saved - 1) * each
    unknown, _ = autosize.choose(spec, cuda_cfg(), 1, seq, free, clip=False)
    assert unknown.offload_checkpoints is True
    none, _ = autosize.choose(spec, cuda_cfg(), 1, seq, free, clip=False, host_room=0)
    assert none.offload_checkpoints is True  # 13 on the GPU do not fit beside two layers of 29 GiB
    explicit, why = autosize.choose(spec, cuda_cfg(offload_checkpoints=3), 1, seq, int(400 * GIB), clip=False)
    assert explicit.offload_checkpoints == 3 and "3 in pinned host RAM" in why, why
    with pytest.raises(Exception, match="engine.offload_checkpoints must be auto, true, false or a count"):
        load_config(None, ["engine.offload_checkpoints=-1"])


def test_a_layer_too_large_for_the_gpu_gets_its_mlp_in_tiles(spec8) -> None:
    """One 7B layer at 256K tokens needs about 66 GiB whole: on 76 GiB free the rule tiles its MLP half
    (16384-token tiles) and the plan fits; with engine.token_tile: 0 the same run is refused with the numbers;
    at 4096 tokens nothing is tiled."""
    sizes, why = autosize.choose(spec8, cuda_cfg(), 1, 262144, 76 * GIB, clip=True)
    assert sizes.token_tile == autosize.TILE_TOKENS and "tiles of 16384" in why
    terms = autosize.gpu_terms(spec8, cuda_cfg(), 1, 262144, sizes)
    assert sum(terms.values()) <= 76 * GIB
    with pytest.raises(autosize.ResourceError, match="one sequence of 262144 tokens"):
        autosize.choose(spec8, cuda_cfg(token_tile=0), 1, 262144, 76 * GIB, clip=True)
    assert autosize.choose(spec8, cuda_cfg(), 16, 4096, 76 * GIB, clip=True)[0].token_tile == 0


# Tiled runs of the 7B shape measured on an H200 (139.3 GiB free): (layers, tokens, K, last block, pinned
# checkpoints (True: all), the peak of max_memory_allocated in GiB). BENCHMARKS.md has the runs.
TILED_PEAKS = [
    (8, 524288, 2, 2, True, 96.2),
    (28, 524288, 2, 2, 4, 124.2),
    (8, 1048576, 1, 1, True, 128.6),
]


@pytest.mark.parametrize("layers,tokens,k,last,pinned,peak", TILED_PEAKS, ids=lambda v: str(v))
def test_the_tiled_plan_matches_the_peaks_measured_at_long_context(layers, tokens, k, last, pinned, peak) -> None:
    """The plan's terms for the sizes each run had, within 5 % of its peak: a tiled layer keeps its attention
    half's q/k/v and output and three hidden-state copies (input, normed input, the MLP half's input); the
    attention backward's transients and the hidden states beside it are 10 copies (12 untiled, where the
    MLP gradients of the whole sequence dominate)."""
    hf = {**QWEN7B, "num_hidden_layers": layers, "max_position_embeddings": tokens}
    spec = build_spec(ModelConfig(family="qwen2", hf=hf))
    cfg = cuda_cfg(offload_checkpoints=pinned, checkpoint_interval=k, last_block_layers=last)
    sizes, _ = autosize.choose(spec, cfg, 1, tokens, int(139.3 * GIB), clip=True)
    assert sizes.token_tile == 16384 and sizes.loss_chunk_tokens == 8192, sizes
    terms = autosize.gpu_terms(spec, autosize.apply(cfg, sizes), 1, tokens, sizes)
    assert abs(sum(terms.values()) / GIB / peak - 1) < 0.05, terms
    hidden = 3584
    assert autosize.stream_bytes(spec, tokens, 2, 16384) == tokens * 10 * hidden * 2
    assert autosize.stream_bytes(spec, tokens, 2) == autosize.stream_bytes(spec, tokens, 2, tokens)
    assert autosize.stream_bytes(spec, tokens, 2) == tokens * 12 * hidden * 2


def test_a_tiled_layer_counts_its_attention_half_and_one_tile(spec8) -> None:
    whole = autosize.layer_activation_bytes(spec8, 262144, 2)
    tiled = autosize.layer_activation_bytes(spec8, 262144, 2, 16384)
    assert tiled < whole / 2
    assert tiled > autosize.layer_activation_bytes(spec8, 16384, 2) + 262144 * 5 * 3584 * 2
    assert autosize.layer_activation_bytes(spec8, 4096, 2, 16384) == autosize.layer_activation_bytes(spec8, 4096, 2)
