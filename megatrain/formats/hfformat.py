"""Checkpoint tensor names on disk against the model's own parameter names.

transformers 5 holds a layer's routed experts as 3D tensors, `mlp.experts.gate_up_proj` [E, 2·I, H] (each
expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], but its checkpoints keep the
per-expert layout of the published files, and `save_pretrained` writes that layout back (its conversion
mapping, reversed; checked against transformers 5.24 in tests/test_moe_checkpoints.py):

- Mixtral: `block_sparse_moe.experts.{e}.w1 / w3 / w2.weight` (gate, up, down), and the whole MoE block
  under `block_sparse_moe.` instead of `mlp.` (the router is `block_sparse_moe.gate.weight`);
- Qwen2-MoE, Qwen3-MoE, OLMoE: `mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`.

That is the layout `export` writes (`pieces`). On import every layout HF's loader takes is read (`layouts`):
a parameter under its own name (the 3D layout, as a checkpoint saved from the model's state dict holds
it) first, then per expert, then under the block's other name (Mixtral's 3D tensors or per-expert ones
under `block_sparse_moe.` or `mlp.`, both of which HF renames). GPT-OSS files hold the 3D tensors
themselves; the published ones hold the experts in MXFP4 (`<name>_blocks`, `<name>_scales`), dequantized
here into fp32 (megatrain/formats/mxfp4.py). Every other tensor is stored under its parameter's name.

`check` finds, from the tensors' names and shapes alone (the safetensors headers), what keeps a checkpoint
from giving a parameter: a tensor missing in every layout, or one of the wrong shape, named.

`Piece`: one tensor on disk and where it sits in its parameter (an expert, and a range of its rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatrain.formats import mxfp4

# Per family: the MoE block's prefixes on disk (the one HF writes first), and the per-expert names of
# (gate, up) and down.
_PER_EXPERT = {
    "mixtral": (("block_sparse_moe.", "mlp."), ("w1.weight", "w3.weight"), "w2.weight"),
    "qwen2_moe": (("mlp.",), ("gate_proj.weight", "up_proj.weight"), "down_proj.weight"),
    "qwen3_moe": (("mlp.",), ("gate_proj.weight", "up_proj.weight"), "down_proj.weight"),
    "olmoe": (("mlp.",), ("gate_proj.weight", "up_proj.weight"), "down_proj.weight"),
}
_GATE_UP, _DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# safetensors dtype tags of the MXFP4 pair
_UINT8 = "U8"


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


def layouts(family: str, name: str, shape: tuple[int, ...]) -> list[list[Piece]]:
    """Every layout besides its own name that HF's loader reads a parameter of this family from, each as
    its pieces, the one HF's save_pretrained writes first: the routed experts per expert (under each
    block prefix), then the parameter under each block prefix. [[the parameter]] for the rest."""
    layer, rest = _split(name)
    spec = _PER_EXPERT.get(family)
    if spec is None or not layer or not rest.startswith("mlp."):
        return [[Piece(name, None, None)]]
    blocks, (gate, up), down = spec
    out = []
    if rest in (_GATE_UP, _DOWN) and len(shape) == 3:
        for block in blocks:
            base = f"{layer}{block}experts."
            if rest == _DOWN:
                out.append([Piece(f"{base}{e}.{down}", e, None) for e in range(shape[0])])
            else:
                half = shape[1] // 2
                out.append(
                    [
                        Piece(f"{base}{e}.{proj}", e, rows)
                        for e in range(shape[0])
                        for proj, rows in ((gate, (0, half)), (up, (half, shape[1])))
                    ]
                )
    out += [[Piece(f"{layer}{block}{rest[len('mlp.') :]}", None, None)] for block in blocks]
    return out


def pieces(family: str, name: str, shape: tuple[int, ...]) -> list[Piece]:
    """Where a parameter of this family is on disk, in the layout HF's save_pretrained writes."""
    return layouts(family, name, shape)[0]


def piece_of(param: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of a parameter (or of a view of it) that `piece` stores."""
    out = param if piece.expert is None else param[piece.expert]
    return out if piece.rows is None else out[piece.rows[0] : piece.rows[1]]


def _piece_shape(shape: tuple[int, ...], piece: Piece) -> tuple[int, ...]:
    """The shape of piece_of(a parameter of `shape`, piece)."""
    out = shape if piece.expert is None else shape[1:]
    return out if piece.rows is None else (piece.rows[1] - piece.rows[0], *out[1:])


def source(family: str, name: str, shape: tuple[int, ...], names: set[str] | dict) -> list[Piece] | None:
    """The pieces a checkpoint whose tensor names are `names` holds the parameter as, not quantized: the
    first layout that is all there (its own name first); None when none is (MXFP4 is not looked at)."""
    for layout in ([Piece(name, None, None)], *layouts(family, name, shape)):
        if all(p.name in names for p in layout):
            return layout
    return None


def _of(name: str, piece: Piece) -> str:
    """Where a piece sits in its parameter, for an error: '' for the whole of it."""
    return "" if piece.expert is None else f" (expert {piece.expert} of '{name}')"


def read(
    family: str,
    name: str,
    shape: tuple[int, ...],
    names: set[str] | dict,
    get: Callable[[str], torch.Tensor],
) -> torch.Tensor | None:
    """The parameter as fp32, assembled from the checkpoint whose tensor names are `names` (read with
    `get`); None when the checkpoint holds it in no layout known here. A piece of another shape than its
    part of the parameter is a ValueError naming it (copied in, it could broadcast)."""
    if name in names:
        return get(name).float()
    blocks, scales = mxfp4.packed_names(name)
    if blocks in names and scales in names:
        return mxfp4.dequantize(get(blocks), get(scales))
    parts = source(family, name, shape, names)
    if parts is None:
        return None
    out = torch.empty(shape, dtype=torch.float32)
    for p in parts:
        t, dst = get(p.name), piece_of(out, p)
        if t.shape != dst.shape:
            raise ValueError(
                f"'{p.name}'{_of(name, p)} has shape {tuple(t.shape)}, the model config expects {tuple(dst.shape)}"
            )
        dst.copy_(t)
    return out


def missing(family: str, name: str, shape: tuple[int, ...], names: set[str] | dict) -> str:
    """What a checkpoint lacks for this parameter, to name in an error: the tensor (quoted), the other half
    of an MXFP4 pair that is there in part, and for GPT-OSS's experts the MXFP4 pair that would do instead.
    A layout that is there in part (a layer's experts but one) names what it lacks; none at all names the
    parameter and the layout HF writes."""
    blocks, scales = mxfp4.packed_names(name)
    if (blocks in names) != (scales in names):
        there, lacks = (blocks, scales) if blocks in names else (scales, blocks)
        return f"'{lacks}' (the MXFP4 pair of '{there}')"
    options = layouts(family, name, shape)
    found = [sum(p.name in names for p in layout) for layout in options]
    if max(found) > 0:  # the most complete one
        layout = options[found.index(max(found))]
        p = next(p for p in layout if p.name not in names)
        return f"'{p.name}'{_of(name, p)}"
    if family == "gpt_oss" and _split(name)[1] in (_GATE_UP, _DOWN):
        return f"'{name}' (nor its MXFP4 pair '{blocks}', '{scales}')"
    written = options[0][0]
    if written.name == name:
        return f"'{name}'"
    if written.expert is None:
        return f"'{name}' (nor '{written.name}')"
    return f"'{name}' (nor per expert, as '{written.name}' and the like)"


def check(family: str, name: str, shape: tuple[int, ...], tensors: dict[str, dict]) -> str | None:
    """What keeps a checkpoint from giving this parameter, from its safetensors headers alone (`tensors`:
    name -> {'dtype', 'shape'}): a tensor missing in every layout, or one of the wrong shape; None when
    `read` will find it whole."""
    shape = tuple(shape)

    def wrong(t: str, want: tuple[int, ...], where: str = "") -> str | None:
        got = tuple(tensors[t]["shape"])
        return None if got == want else f"tensor '{t}'{where} has shape {got}, the model config expects {want}"

    if name in tensors:
        return wrong(name, shape)
    blocks, scales = mxfp4.packed_names(name)
    if blocks in tensors and scales in tensors:
        dtypes = (tensors[blocks]["dtype"], tensors[scales]["dtype"])
        if dtypes != (_UINT8, _UINT8):
            return f"MXFP4 tensors '{blocks}' and '{scales}' must be uint8 ({_UINT8}), got {dtypes[0]} and {dtypes[1]}"
        try:
            got = mxfp4.dequantized_shape(tuple(tensors[blocks]["shape"]))
        except ValueError as exc:
            return f"tensor '{blocks}': {exc}"
        if got != shape:
            return f"tensor '{blocks}' dequantizes to shape {got}, the model config expects {shape}"
        want = tuple(tensors[blocks]["shape"][:3])
        if tuple(tensors[scales]["shape"]) != want:
            return f"tensor '{scales}' has shape {tuple(tensors[scales]['shape'])}, its blocks '{blocks}' need {want}"
        return None
    parts = source(family, name, shape, tensors)
    if parts is None:
        return f"tensor {missing(family, name, shape, tensors)} is missing from the checkpoint"
    return next((w for p in parts if (w := wrong(p.name, _piece_shape(shape, p), _of(name, p)))), None)
