"""MXFP4 (GPT-OSS expert weights): dequantize against HF's own conversion, quantize round trips, shapes."""

from __future__ import annotations

import pytest
import torch

from megatrain.formats import mxfp4

hf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

# the FP4 e2m1 magnitudes; any of them times one power of two per block survives quantization exactly
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _random_packed(
    gen: torch.Generator, experts: int, rows: int, groups: int, lo: int = 117, hi: int = 138
) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(lo, hi, (experts, rows, groups), dtype=torch.uint8, generator=gen)
    return blocks, scales


def _hf_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # what HF's loader puts into gate_up_proj / down_proj, asked for in fp32
    return hf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bitwise, so that -0.0 and 0.0 count as different
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("chunk_elements", [1, 3 * 64 * 96, mxfp4.DEFAULT_CHUNK_ELEMENTS])
def test_dequantize_matches_hf_bit_for_bit(chunk_elements: int) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks, scales = _random_packed(gen, experts=5, rows=96, groups=2)
    ours = mxfp4.dequantize(blocks, scales, chunk_elements=chunk_elements)
    assert ours.shape == (5, 64, 96) and ours.dtype == torch.float32
    assert _same_bits(ours, _hf_reference(blocks, scales))


def test_dequantize_matches_hf_over_the_whole_scale_range() -> None:
    # 255 is left out: e8m0's NaN, where HF (and we) give inf / NaN
    gen = torch.Generator().manual_seed(1)
    blocks, scales = _random_packed(gen, experts=2, rows=64, groups=4, lo=0, hi=255)
    assert _same_bits(mxfp4.dequantize(blocks, scales), _hf_reference(blocks, scales))


def test_nibble_order_and_orientation() -> None:
    # one expert, one output row, one block: byte 0 = 0x72 -> element 0 is code 2 (1.0), element 1 code 7 (6.0)
    blocks = torch.zeros((1, 1, 1, 16), dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x72
    blocks[0, 0, 0, 15] = 0x9F  # element 30: code 15 (-6.0), element 31: code 9 (-0.5)
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)  # factor 2
    w = mxfp4.dequantize(blocks, scales)
    assert w.shape == (1, 32, 1)  # the block runs along the parameter's input dim
    assert w[0, :2, 0].tolist() == [2.0, 12.0]
    assert w[0, 30:, 0].tolist() == [-12.0, -1.0]
    assert w[0, 2:30, 0].abs().sum() == 0


def test_quantize_round_trip_exact_on_the_grid() -> None:
    gen = torch.Generator().manual_seed(2)
    experts, in_dim, out_dim = 3, 96, 40
    groups = in_dim // 32
    mags = GRID[torch.randint(0, len(GRID), (experts, out_dim, groups, 32), generator=gen)]
    signs = torch.where(torch.rand(mags.shape, generator=gen) < 0.5, -1.0, 1.0)
    # one power of two per block, from tiny to large (but leaving fp32 normal)
    powers = torch.randint(-100, 100, (experts, out_dim, groups, 1), generator=gen).to(torch.float32)
    disk = mags * signs * torch.exp2(powers)
    weight = disk.reshape(experts, out_dim, in_dim).transpose(1, 2).contiguous()
    blocks, scales = mxfp4.quantize(weight)
    assert blocks.shape == (experts, out_dim, groups, 16) and blocks.dtype == torch.uint8
    assert scales.shape == (experts, out_dim, groups) and scales.dtype == torch.uint8
    assert _same_bits(mxfp4.dequantize(blocks, scales), weight)
    # and the packed bytes themselves survive a second trip
    again = mxfp4.quantize(mxfp4.dequantize(blocks, scales), chunk_elements=1)
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)


def test_quantize_dequantize_random_codes_are_a_fixed_point() -> None:
    # any checkpoint whose blocks already use the full range (largest code 6.0) re-quantizes to itself
    gen = torch.Generator().manual_seed(3)
    blocks, scales = _random_packed(gen, experts=2, rows=32, groups=2)
    blocks[..., 0] = 0x07  # element 0 of every block is 6.0, so the scale is forced
    w = mxfp4.dequantize(blocks, scales)
    b2, s2 = mxfp4.quantize(w)
    assert torch.equal(s2, scales)
    assert _same_bits(mxfp4.dequantize(b2, s2), w)


def test_quantize_error_on_random_normals() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn((4, 128, 48), generator=gen) * 0.02
    blocks, scales = mxfp4.quantize(weight)
    back = mxfp4.dequantize(blocks, scales)
    factor = torch.exp2(scales.to(torch.float32) - 127).unsqueeze(-1)  # [E, out, G, 1]
    disk = weight.transpose(1, 2).reshape(4, 48, 4, 32)
    err = (back - weight).transpose(1, 2).reshape(4, 48, 4, 32).abs()
    # the scale brings each block's max into (3, 6], so no value saturates and the error is at most half the
    # widest step (2, between 4 and 6) times the block's factor; that factor is below a third of the max
    assert (err <= factor).all()
    assert (factor < disk.abs().amax(-1, keepdim=True) / 3).all()
    # rounding to nearest: no FP4 value at the block's scale is closer
    candidates = torch.cat((GRID, -GRID)) * factor.unsqueeze(-1)  # [E, out, G, 1, 16]
    nearest = (disk.unsqueeze(-1) - candidates).abs().amin(-1)
    assert torch.equal(err, nearest)
    # and on the whole, 4 bits give a relative RMS error of roughly 10%
    rel = (back - weight).norm() / weight.norm()
    assert 0.03 < rel < 0.2


def test_quantize_rounds_ties_to_even() -> None:
    # scale pinned by a 6.0 in element 0; the others sit on midpoints between FP4 magnitudes
    row = torch.zeros(32)
    row[0] = 6.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row[1:8] = ties
    row[8:15] = -ties
    weight = row.view(1, 32, 1)
    back = mxfp4.dequantize(*mxfp4.quantize(weight))[0, :, 0]
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert back[1:8].tolist() == expected.tolist()
    assert back[8:15].tolist() == (-expected).tolist()


def test_tiny_gpt_oss_shapes_load_into_the_experts() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4)
    experts = GptOssExperts(config)
    hidden, inter, n = 64, 32, 4
    gen = torch.Generator().manual_seed(5)
    # on disk: rows are the output dim, blocks of 32 along the input dim
    gate_up = _random_packed(gen, experts=n, rows=2 * inter, groups=hidden // 32)
    down = _random_packed(gen, experts=n, rows=hidden, groups=inter // 32)
    weights = {"gate_up_proj": mxfp4.dequantize(*gate_up), "down_proj": mxfp4.dequantize(*down)}
    for name, w in weights.items():
        param = getattr(experts, name)
        assert w.shape == param.shape, name
        assert mxfp4.dequantized_shape((gate_up if name == "gate_up_proj" else down)[0].shape) == tuple(param.shape)
    assert weights["gate_up_proj"].shape == (n, hidden, 2 * inter)
    assert weights["down_proj"].shape == (n, inter, hidden)
    # and the module computes with them: x @ gate_up_proj[e] needs [hidden, 2 * inter]
    with torch.no_grad():
        experts.gate_up_proj.copy_(weights["gate_up_proj"])
        experts.down_proj.copy_(weights["down_proj"])
        experts.gate_up_proj_bias.zero_()
        experts.down_proj_bias.zero_()
        x = torch.randn(3, hidden, generator=gen)
        idx = torch.tensor([[0, 1], [2, 3], [1, 2]])
        out = experts(x, idx, torch.full((3, 2), 0.5))
    assert out.shape == (3, hidden) and torch.isfinite(out).all()


def test_packed_names() -> None:
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert mxfp4.packed_names(name) == (
        "model.layers.0.mlp.experts.gate_up_proj_blocks",
        "model.layers.0.mlp.experts.gate_up_proj_scales",
    )
    assert mxfp4.packed_names("model.layers.11.mlp.experts.down_proj")[1].endswith("down_proj_scales")
    assert mxfp4.QUANTIZED_SUFFIXES == ("_blocks", "_scales")
    with pytest.raises(ValueError, match="already"):
        mxfp4.packed_names(name + "_blocks")


@pytest.mark.parametrize(
    ("blocks_shape", "scales_shape", "match"),
    [
        ((2, 8, 2, 16), (2, 8, 3), r"\(2, 8, 3\).*\(2, 8, 2, 16\)"),  # scales disagree with blocks
        ((2, 8, 2, 8), (2, 8, 2), r"\(2, 8, 2, 8\)"),  # not 16 bytes a block
        ((8, 2, 16), (8, 2), r"\(8, 2, 16\)"),  # no expert dim
        ((2, 8, 2, 16), (2, 8), r"\(2, 8\)"),
    ],
)
def test_dequantize_rejects_bad_shapes(blocks_shape: tuple, scales_shape: tuple, match: str) -> None:
    blocks = torch.zeros(blocks_shape, dtype=torch.uint8)
    scales = torch.full(scales_shape, 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        mxfp4.dequantize(blocks, scales)


def test_dequantize_rejects_bad_dtypes() -> None:
    blocks = torch.zeros((1, 4, 1, 16), dtype=torch.uint8)
    scales = torch.full((1, 4, 1), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(blocks.to(torch.int8), scales)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(blocks, scales.to(torch.int32))


def test_quantize_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\(2, 33, 4\)"):
        mxfp4.quantize(torch.zeros(2, 33, 4))
    with pytest.raises(ValueError, match=r"\(32, 4\)"):
        mxfp4.quantize(torch.zeros(32, 4))
    with pytest.raises(ValueError, match="floating"):
        mxfp4.quantize(torch.zeros((1, 32, 4), dtype=torch.int32))
    bad = torch.zeros(1, 32, 4)
    bad[0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        mxfp4.quantize(bad)
