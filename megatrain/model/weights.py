"""Moving tensors between HF state dicts (names, shapes) and unit tiles (flat fp32 vectors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from megatrain.errors import ConfigError
from megatrain.formats import hfformat
from megatrain.model.arch import holds_weights as holds_weights  # its home is the torch-free arch.py
from megatrain.model.spec import ModelSpec


def fill_tile(spec: ModelSpec, unit: int, tile: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Write a unit's tensors (keyed by slot name) into its flat tile; padding is zeroed."""
    tile.zero_()
    copy_slots(spec, unit, tile, tensors)


def copy_slots(spec: ModelSpec, unit: int, tile: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Write each slot of a unit's tile from `tensors` (keyed by slot name), checking names and shapes; a
    tensor that already is its slot (drawn in place) is left as it is."""
    for s in spec.layout.structure_of(unit).slots:
        if s.name not in tensors:
            raise ConfigError(f"weights for unit {unit} lack '{spec.layout.hf_name(unit, s.name)}'")
        src = tensors[s.name]
        if tuple(src.shape) != s.shape:
            raise ConfigError(
                f"'{spec.layout.hf_name(unit, s.name)}' has shape {tuple(src.shape)}, "
                f"the model config expects {s.shape}"
            )
        dst = tile[s.offset : s.offset + s.numel]
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src.reshape(-1))


def slot_views(spec: ModelSpec, unit: int, tile: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of a unit's tile keyed by slot name, each in its tensor's shape."""
    return {s.name: tile[s.offset : s.offset + s.numel].view(s.shape) for s in spec.layout.structure_of(unit).slots}


def tile_tensors(spec: ModelSpec, unit: int, tile: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF-named views of a unit's tile."""
    st = spec.layout.structure_of(unit)
    return {spec.layout.hf_name(unit, s.name): tile[s.offset : s.offset + s.numel].view(s.shape) for s in st.slots}


def unit_from_state(spec: ModelSpec, unit: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pick a unit's tensors out of an HF state dict, keyed by slot name."""
    st = spec.layout.structure_of(unit)
    return {
        s.name: state[spec.layout.hf_name(unit, s.name)] for s in st.slots if spec.layout.hf_name(unit, s.name) in state
    }


def flat_unit(spec: ModelSpec, unit: int, state: dict[str, torch.Tensor]) -> torch.Tensor:
    tile = torch.zeros(spec.layout.structure_of(unit).numel, dtype=torch.float32)
    fill_tile(spec, unit, tile, unit_from_state(spec, unit, state))
    return tile


def checkpoint_index(directory: str | Path) -> dict[str, Path]:
    """Map every tensor name of a save_pretrained directory to its safetensors file, after checking that
    every file is whole (its header parses and its size covers every tensor the header lists); no
    tensor data is read."""
    return {name: path for name, (path, _) in _headers(directory).items()}


def check_checkpoint(spec: ModelSpec, directory: str | Path) -> None:
    """checkpoint_index's checks, and every parameter of the model there, in a layout read_unit reads
    (megatrain/formats/hfformat.py), of its shape: a ConfigError naming the first tensor missing or misshapen. From
    the files' headers alone, so a checkpoint that cannot fill the store is refused before the store is made."""
    tensors = {name: entry for name, (_, entry) in _headers(directory).items()}
    for u in spec.layout.units:
        for s in spec.layout.structure_of(u.index).slots:
            problem = hfformat.check(spec.family, spec.layout.hf_name(u.index, s.name), s.shape, tensors)
            if problem:
                raise ConfigError(f"model.pretrained: {problem}")


def _headers(directory: str | Path) -> dict[str, tuple[Path, dict]]:
    """Every tensor of a save_pretrained directory: (its file, its header entry), each file checked whole."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            where = {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        except (ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(f"model.pretrained: {index} is not a safetensors index ({exc})") from None
    elif (root / "model.safetensors").is_file():
        path = root / "model.safetensors"
        return {name: (path, entry) for name, entry in _header(path).items()}  # checked whole
    else:
        raise ConfigError(f"model.pretrained: '{root}' holds no model.safetensors (or sharded index)")
    by_file: dict[Path, list[str]] = {}
    for name, path in where.items():
        by_file.setdefault(path, []).append(name)
    out = {}
    for path in sorted(by_file):
        names = _header(path)
        missing = [k for k in by_file[path] if k not in names]
        if missing:
            raise ConfigError(
                f"model.pretrained: {path} lacks {len(missing)} tensors its index puts there (first: '{missing[0]}')"
            )
        out.update((k, (path, names[k])) for k in by_file[path])
    return out


def _header(path: Path) -> dict[str, dict]:
    """The tensors of a safetensors file, from its header; a missing, truncated or foreign file is a
    ConfigError naming it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"model.pretrained: {path} is not a readable safetensors file ({exc})") from None
    if 8 + n + end > size:
        raise ConfigError(
            f"model.pretrained: {path} is truncated: its header needs {8 + n + end} bytes, the file has {size}"
        )
    return tensors


def read_unit(spec: ModelSpec, unit: int, where: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Read one unit's tensors from a checkpoint, in whichever layout it holds them (megatrain/formats/hfformat.py:
    per-expert tensors, MXFP4 experts); reads only those tensors."""
    files: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        try:
            if where[name] not in files:
                files[where[name]] = safe_open(where[name], "pt")
            return files[where[name]].get_tensor(name)
        except Exception as exc:  # safetensors raises its own types; name the file either way
            raise ConfigError(f"model.pretrained: cannot read tensor '{name}' from {where[name]}: {exc}") from None

    out = {}
    for s in spec.layout.structure_of(unit).slots:
        name = spec.layout.hf_name(unit, s.name)
        try:
            tensor = hfformat.read(spec.family, name, s.shape, where, get)
        except ValueError as exc:  # a quantized pair that does not decode
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"model.pretrained: tensor '{name}': {exc}") from None
        if tensor is None:
            lacks = hfformat.missing(spec.family, name, s.shape, where)
            raise ConfigError(f"model.pretrained: tensor {lacks} is missing from the checkpoint")
        out[s.name] = tensor
    return out
