"""Checkpoint tensor names on disk against the model's own parameter names.

transformers 5 holds a layer's routed experts as 3D tensors, `mlp.experts.gate_up_proj` [E, 2·I, H] (each
expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], but its checkpoints keep the
per-expert layout of the published files, and `save_pretrained` writes that layout back:

- Mixtral: `block_sparse_moe.experts.{e}.w1 / w3 / w2.weight` (gate, up, down), and the whole MoE block
  under `block_sparse_moe.` instead of `mlp.`;
- Qwen2-MoE, Qwen3-MoE, OLMoE: `mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`.

GPT-OSS files hold the 3D tensors themselves; the published ones hold the experts in MXFP4
(`<name>_blocks`, `<name>_scales`), dequantized here into fp32 (megatrain/mxfp4.py). Every other tensor
is stored under its parameter's name. A checkpoint that already holds a parameter under its own name
(the 3D layout) is read as it is.

`Piece`: one tensor on disk and where it sits in its parameter (an expert, and a range of its rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatrain import mxfp4

# Per family: the MoE block's prefix on disk, and the per-expert names of (gate, up) and down.
_PER_EXPERT = {
    "mixtral": ("block_sparse_moe.", ("w1.weight", "w3.weight"), "w2.weight"),
    "qwen2_moe": ("mlp.", ("gate_proj.weight", "up_proj.weight"), "down_proj.weight"),
    "qwen3_moe": ("mlp.", ("gate_proj.weight", "up_proj.weight"), "down_proj.weight"),
    "olmoe": ("mlp.", ("gate_proj.weight", "up_proj.weight"), "down_proj.weight"),
}
_GATE_UP, _DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


@dataclass(frozen=True)
class Piece:
    name: str  # on disk
    expert: int | None  # None: the whole parameter
    rows: tuple[int, int] | None  # the expert's rows this piece fills (gate or up half); None: all


def _split(name: str) -> tuple[str, str]:
    """(layer prefix 'model.layers.3.', the rest) of a parameter name; ('', name) outside the layers."""
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        return ".".join(parts[:3]) + ".", ".".join(parts[3:])
    return "", name


def pieces(family: str, name: str, shape: tuple[int, ...]) -> list[Piece]:
    """Where a parameter of this family is on disk, in the per-expert layout HF writes."""
    layer, rest = _split(name)
    spec = _PER_EXPERT.get(family)
    if spec is None or not layer:
        return [Piece(name, None, None)]
    block, (gate, up), down = spec
    if rest in (_GATE_UP, _DOWN) and len(shape) == 3:
        base = f"{layer}{block}experts."
        if rest == _DOWN:
            return [Piece(f"{base}{e}.{down}", e, None) for e in range(shape[0])]
        half = shape[1] // 2
        return [
            Piece(f"{base}{e}.{proj}", e, rows)
            for e in range(shape[0])
            for proj, rows in ((gate, (0, half)), (up, (half, shape[1])))
        ]
    if rest.startswith("mlp."):
        return [Piece(f"{layer}{block}{rest[len('mlp.') :]}", None, None)]
    return [Piece(name, None, None)]


def piece_of(param: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of a parameter (or of a view of it) that `piece` stores."""
    out = param if piece.expert is None else param[piece.expert]
    return out if piece.rows is None else out[piece.rows[0] : piece.rows[1]]


def read(
    family: str,
    name: str,
    shape: tuple[int, ...],
    names: set[str] | dict,
    get: Callable[[str], torch.Tensor],
) -> torch.Tensor | None:
    """The parameter as fp32, assembled from the checkpoint whose tensor names are `names` (read with
    `get`); None when the checkpoint holds it in no layout known here."""
    if name in names:
        return get(name).float()
    blocks, scales = mxfp4.packed_names(name)
    if blocks in names and scales in names:
        return mxfp4.dequantize(get(blocks), get(scales))
    parts = pieces(family, name, shape)
    if len(parts) == 1 and parts[0].name == name or not all(p.name in names for p in parts):
        return None
    out = torch.empty(shape, dtype=torch.float32)
    for p in parts:
        piece_of(out, p).copy_(get(p.name))
    return out


def missing(family: str, name: str, shape: tuple[int, ...], names: set[str] | dict) -> str:
    """What a checkpoint lacks for this parameter, to name in an error: the tensor (quoted), the other half
    of an MXFP4 pair that is there in part, and for GPT-OSS's experts the MXFP4 pair that would do instead."""
    blocks, scales = mxfp4.packed_names(name)
    if (blocks in names) != (scales in names):
        there, lacks = (blocks, scales) if blocks in names else (scales, blocks)
        return f"'{lacks}' (the MXFP4 pair of '{there}')"
    lacks = next((p.name for p in pieces(family, name, shape) if p.name not in names), name)
    if lacks == name and family == "gpt_oss" and _split(name)[1] in (_GATE_UP, _DOWN):
        return f"'{name}' (nor its MXFP4 pair '{blocks}', '{scales}')"
    return f"'{lacks}'"
