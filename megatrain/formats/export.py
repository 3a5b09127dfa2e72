"""HF save_pretrained directories written unit by unit: sharded safetensors (each shard at most
`shard_bytes`) and model.safetensors.index.json, config.json, generation_config.json, the tokenizer's
files when there is a tokenizer, and megatrain_export.json (the step exported). Shards are planned from
the layout up front (every tensor's name, dtype and shape is known), so each file's header is written
first and the tensor data streamed after it: peak memory is one unit's tensors in the output dtype, never
a shard or the model."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from megatrain.formats import hfformat
from megatrain.formats.hfformat import Piece
from megatrain.model.spec import ModelSpec
from megatrain.model.specialids import apply_ids, run_tokenizer, special_ids

DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16")}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
RECORD = "megatrain_export.json"  # the source checkpoint's step and path; from_pretrained reads no such file


def _tensors(spec: ModelSpec) -> list[tuple[int, str, Piece, tuple[int, ...]]]:
    """(unit, slot name, the piece on disk, its shape) of every tensor, in unit order: a parameter HF keeps
    per expert on disk is written per expert (megatrain/formats/hfformat.py)."""
    layout = spec.layout
    out = []
    for u in layout.units:
        for s in layout.structure_of(u.index).slots:
            probe = torch.empty(s.shape, device="meta")
            for p in hfformat.pieces(spec.family, layout.hf_name(u.index, s.name), s.shape):
                out.append((u.index, s.name, p, tuple(hfformat.piece_of(probe, p).shape)))
    return out


def _plan(spec: ModelSpec, itemsize: int, shard_bytes: int) -> list[list[tuple[int, str, Piece, tuple[int, ...]]]]:
    """Tensors grouped into shards of at most shard_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list] = [[]]
    size = 0
    for t in _tensors(spec):
        n = itemsize * int(torch.Size(t[3]).numel())
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def export(
    spec: ModelSpec,
    tile: Callable[[int], torch.Tensor],
    out: str | Path,
    dtype: str = "fp32",
    shard_bytes: int = 5 * 10**9,
    run: dict | None = None,
    tokenizer: str | Path | None = None,
    record: dict | None = None,
) -> Path:
    """Write the model whose unit u's flat fp32 tile is `tile(u)` as an HF directory at `out`. `run`: the
    run's resolved config as plain data, which decides the special-token ids and the tokenizer copied
    (megatrain/model/specialids.py; `tokenizer` names another); `record`: what RECORD says of the source (its
    step, checkpoint, run id), beside the files HF reads."""
    torch_dtype, tag = DTYPES[dtype]
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    shards = _plan(spec, torch_dtype.itemsize, shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    weight_map, total = {}, 0
    cache: dict[int, torch.Tensor] = {}
    for name, shard in zip(names, shards):
        total += _write_shard(root / name, shard, lambda u: _unit(cache, tile, u), torch_dtype, tag, spec)
        weight_map.update({p.name: name for _, _, p, _ in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = copy.deepcopy(spec.hf_config)
    config.dtype = torch_dtype
    config.use_cache = True  # the training spec turns the KV cache off; a saved model is for inference too
    if tokenizer is None and run is not None:
        tokenizer = run_tokenizer(run)
    if tokenizer or run is not None:
        apply_ids(config, special_ids(run or {}, config, str(tokenizer) if tokenizer else None))
    config.save_pretrained(root)
    _generation_config(config, root)
    if tokenizer:
        for f in TOKENIZER_FILES:
            if (Path(tokenizer) / f).is_file():
                shutil.copyfile(Path(tokenizer) / f, root / f)
    if record is not None:
        (root / RECORD).write_text(json.dumps({**record, "dtype": dtype}, indent=2) + "\n")
    for p in root.iterdir():
        if p.is_file():
            os.chmod(p, 0o644)  # a model directory is meant to be shared and loaded by others
    return root


def _unit(cache: dict[int, torch.Tensor], tile: Callable[[int], torch.Tensor], unit: int) -> torch.Tensor:
    """The unit's tile, kept only while its tensors are written (one unit at a time)."""
    if unit not in cache:
        cache.clear()
        cache[unit] = tile(unit)
    return cache[unit]


def _write_shard(
    path: Path, shard: list, tile: Callable[[int], torch.Tensor], dtype: torch.dtype, tag: str, spec: ModelSpec
) -> int:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for _, _, p, shape in shard:
        n = dtype.itemsize * int(torch.Size(shape).numel())
        header[p.name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    st = spec.layout
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for unit, slot, p, _ in shard:
            s = next(x for x in st.structure_of(unit).slots if x.name == slot)
            t = hfformat.piece_of(tile(unit)[s.offset : s.offset + s.numel].view(s.shape), p).to(dtype).contiguous()
            f.write(memoryview(t.view(torch.uint8).numpy()))
    return offset


def _generation_config(config, root: Path) -> None:
    """Generation defaults from the exported config: its special ids, the KV cache on."""
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_model_config(config)
        if gen.to_diff_dict():
            gen.save_pretrained(root)
    except (ImportError, ValueError, TypeError):
        pass  # no generation defaults to write for this config
