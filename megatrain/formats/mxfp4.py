"""MXFP4 expert weights of GPT-OSS checkpoints: dequantize to fp32 HF parameters, and quantize back.

As published (openai/gpt-oss-20b, -120b), each layer's `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`
are stored as two uint8 tensors, `<name>_blocks` [E, out, G, 16] and `<name>_scales` [E, out, G]:

- Every block holds 32 FP4 (e2m1) codes, two per byte, the LOW nibble first: element 2k of a block is
  `byte[k] & 0x0F`, element 2k+1 is `byte[k] >> 4`. A code is a sign bit (0x8) over the magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7); code 8 is -0.0.
- Each block has one e8m0 scale: a bare exponent byte s, the block's factor 2**(s - 127). As in HF's loader,
  s = 255 is not treated as NaN, so it gives inf (and NaN for zero codes).
- Blocks run along the parameter's INPUT (contraction) dim: G * 32 = in. On disk the rows are the output
  dim, so the dequantized [E, out, in] is transposed to the HF parameter's [E, in, out]: gate_up_proj is
  [E, hidden, 2 * intermediate] from blocks [E, 2 * intermediate, hidden / 32, 16], and down_proj is
  [E, intermediate, hidden] from blocks [E, hidden, intermediate / 32, 16].

The biases, the router and attention are stored in bf16 and need nothing from here.
"""

from __future__ import annotations

import torch

QUANTIZED_SUFFIXES = ("_blocks", "_scales")

BLOCK = 32  # FP4 values that share one scale
BLOCK_BYTES = BLOCK // 2  # two codes per byte
SCALE_BIAS = 127  # e8m0: the byte is a biased exponent, as in fp32
FP4_MAX = 6.0

# The magnitudes of codes 0..7; codes 8..15 are the same with the sign bit set.
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_VALUES = _MAGNITUDES + tuple(-m for m in _MAGNITUDES)
# Midpoints between neighbouring magnitudes: a magnitude rounds to code i when it is in (mid[i-1], mid[i]].
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(_MAGNITUDES, _MAGNITUDES[1:]))

# Output elements produced per step; a chunk is always whole experts, at least one. 16 Mi fp32 elements
# (64 MiB) keeps the temporaries of a 120B layer to about one expert's worth.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


def packed_names(param_name: str) -> tuple[str, str]:
    """The checkpoint names of a quantized parameter: `..experts.gate_up_proj` -> (`.._blocks`, `.._scales`)."""
    if param_name.endswith(QUANTIZED_SUFFIXES):
        raise ValueError(f"'{param_name}' already is a packed name; pass the parameter's name")
    blocks_suffix, scales_suffix = QUANTIZED_SUFFIXES
    return param_name + blocks_suffix, param_name + scales_suffix


def dequantized_shape(blocks_shape: tuple[int, ...] | torch.Size) -> tuple[int, int, int]:
    """The HF parameter shape [E, in, out] that blocks of shape [E, out, G, 16] dequantize to."""
    if len(blocks_shape) != 4 or blocks_shape[3] != BLOCK_BYTES:
        raise ValueError(f"MXFP4 blocks must be [experts, out, groups, {BLOCK_BYTES}], got {tuple(blocks_shape)}")
    experts, rows, groups, _ = blocks_shape
    return experts, groups * BLOCK, rows


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> torch.Tensor:
    """The fp32 HF parameter [E, in, out] from MXFP4 `blocks` [E, out, G, 16] and `scales` [E, out, G].

    Bit for bit what HF's loader computes before its cast to the parameter's dtype. The result is allocated
    once; the work goes a few experts at a time so that the temporaries stay near `chunk_elements`.
    """
    _check_packed(blocks, scales)
    experts, in_dim, out_dim = dequantized_shape(blocks.shape)
    out = torch.empty((experts, in_dim, out_dim), dtype=torch.float32, device=blocks.device)
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    step = _experts_per_chunk(in_dim * out_dim, chunk_elements)
    for e0 in range(0, experts, step):
        e1 = min(e0 + step, experts)
        rows = _dequantize_rows(blocks[e0:e1], scales[e0:e1], lut)  # [e, out, in]
        out[e0:e1].copy_(rows.transpose(1, 2))
    return out


def quantize(
    weight: torch.Tensor, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) in the checkpoint's format from an HF-oriented parameter [E, in, out].

    Each block of 32 along `in` gets the smallest power-of-two scale that brings its largest magnitude
    within FP4's 6, then every value rounds to the nearest FP4 value (ties to the even code, as IEEE).
    Values that already are FP4 values times one power of two per block come back exactly.
    """
    if weight.ndim != 3 or not weight.is_floating_point():
        raise ValueError(
            f"quantize needs a floating [experts, in, out] tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    experts, in_dim, out_dim = weight.shape
    if in_dim % BLOCK:
        raise ValueError(f"the input dim of {tuple(weight.shape)} is not a multiple of the block size {BLOCK}")
    groups = in_dim // BLOCK
    blocks = torch.empty((experts, out_dim, groups, BLOCK_BYTES), dtype=torch.uint8, device=weight.device)
    scales = torch.empty((experts, out_dim, groups), dtype=torch.uint8, device=weight.device)
    step = _experts_per_chunk(in_dim * out_dim, chunk_elements)
    for e0 in range(0, experts, step):
        e1 = min(e0 + step, experts)
        # to the disk's orientation: rows are the output dim, the blocks run along the input dim
        rows = weight[e0:e1].to(torch.float32).transpose(1, 2).contiguous().view(e1 - e0, out_dim, groups, BLOCK)
        if not torch.isfinite(rows).all():
            raise ValueError(f"quantize got non-finite values in experts {e0}..{e1 - 1}")
        blocks[e0:e1], scales[e0:e1] = _quantize_rows(rows)
    return blocks, scales


def _check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    dequantized_shape(blocks.shape)  # raises on a malformed blocks shape
    if tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(
            f"MXFP4 scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}: "
            f"expected {tuple(blocks.shape[:3])}"
        )
    if blocks.device != scales.device:
        raise ValueError(f"MXFP4 blocks are on {blocks.device} but scales on {scales.device}")


def _experts_per_chunk(elements_per_expert: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, elements_per_expert))


def _dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """[e, out, G, 16] codes and [e, out, G] exponents -> fp32 [e, out, G * 32], still in the disk's orientation."""
    e, rows, groups, _ = blocks.shape
    # interleave low and high nibbles so that element 2k is the low nibble of byte k
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).view(e, rows, groups, BLOCK)
    values = lut[codes.long()]  # a uint8 index would be read as a mask
    # an exact power of two, so the product is exact wherever it stays in fp32's range
    factor = torch.exp2(scales.to(torch.float32) - SCALE_BIAS)
    values.mul_(factor.unsqueeze(-1))
    return values.view(e, rows, groups * BLOCK)


def _block_exponents(amax: torch.Tensor) -> torch.Tensor:
    """The smallest integer k with amax <= 6 * 2**k, limited to what e8m0 holds; 0 for an all-zero block."""
    # frexp gives amax / 6 = m * 2**x with m in [0.5, 1): ceil(log2) is x, or x - 1 when m is exactly 0.5
    mantissa, exponent = torch.frexp(amax / FP4_MAX)
    k = exponent - (mantissa == 0.5).to(exponent.dtype)
    # 255 is e8m0's NaN, so 254 is the largest usable byte
    return k.clamp(-SCALE_BIAS, 254 - SCALE_BIAS)


def _round_to_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Nearest FP4 code (uint8, 0..15) of each value of `scaled`, which is already within about +-6."""
    magnitude = scaled.abs()
    # count the midpoints passed; a value exactly on one goes to the even code (IEEE's ties to even), which
    # is the upper neighbour for the odd-numbered midpoints. Seven compares beat bucketize plus a tie fix-up.
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for i, mid in enumerate(_MIDPOINTS):
        code += (magnitude >= mid) if i % 2 else (magnitude > mid)
    # signbit keeps -0.0 (and small negatives that round to zero) as code 8, -0.0
    return code | (torch.signbit(scaled).to(torch.uint8) << 3)


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [e, out, G, 32] -> (blocks [e, out, G, 16], scales [e, out, G]), both uint8."""
    k = _block_exponents(rows.abs().amax(dim=-1))
    # multiply by 2**-k rather than divide: 2**127 is a normal float where 2**-127 is not
    codes = _round_to_codes(rows * torch.exp2(-k.to(torch.float32)).unsqueeze(-1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (k + SCALE_BIAS).to(torch.uint8)
