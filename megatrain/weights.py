"""Moving tensors between HF state dicts (names, shapes) and unit tiles (flat fp32 vectors)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain.errors import ConfigError
from megatrain.model import ModelSpec


def fill_tile(spec: ModelSpec, unit: int, tile: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Write a unit's tensors (keyed by slot name) into its flat tile; padding is zeroed."""
    st = spec.layout.structure_of(unit)
    tile.zero_()
    for s in st.slots:
        if s.name not in tensors:
            raise ConfigError(f"weights for unit {unit} lack '{spec.layout.hf_name(unit, s.name)}'")
        src = tensors[s.name]
        if tuple(src.shape) != s.shape:
            raise ConfigError(f"'{spec.layout.hf_name(unit, s.name)}' has shape {tuple(src.shape)}, "
                              f"the model config expects {s.shape}")
        tile[s.offset: s.offset + s.numel].copy_(src.reshape(-1))


def tile_tensors(spec: ModelSpec, unit: int, tile: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF-named views of a unit's tile."""
    st = spec.layout.structure_of(unit)
    return {spec.layout.hf_name(unit, s.name): tile[s.offset: s.offset + s.numel].view(s.shape) for s in st.slots}


def unit_from_state(spec: ModelSpec, unit: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pick a unit's tensors out of an HF state dict, keyed by slot name."""
    st = spec.layout.structure_of(unit)
    return {s.name: state[spec.layout.hf_name(unit, s.name)] for s in st.slots
            if spec.layout.hf_name(unit, s.name) in state}


def flat_unit(spec: ModelSpec, unit: int, state: dict[str, torch.Tensor]) -> torch.Tensor:
    tile = torch.zeros(spec.layout.structure_of(unit).numel, dtype=torch.float32)
    fill_tile(spec, unit, tile, unit_from_state(spec, unit, state))
    return tile


def checkpoint_index(directory: str | Path) -> dict[str, Path]:
    """Map every tensor name of a save_pretrained directory to its safetensors file (no data read)."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    if (root / "model.safetensors").is_file():
        with safe_open(root / "model.safetensors", "pt") as f:
            return dict.fromkeys(f.keys(), root / "model.safetensors")
    raise ConfigError(f"model.pretrained: '{root}' holds no model.safetensors (or sharded index)")


def read_unit(spec: ModelSpec, unit: int, where: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Read one unit's tensors from a checkpoint; reads only those tensors."""
    out = {}
    for s in spec.layout.structure_of(unit).slots:
        name = spec.layout.hf_name(unit, s.name)
        if name not in where:
            raise ConfigError(f"model.pretrained: tensor '{name}' is missing from the checkpoint")
        with safe_open(where[name], "pt") as f:
            out[s.name] = f.get_tensor(name).float()
    return out


def save_units(spec: ModelSpec, tiles: Iterable[tuple[int, torch.Tensor]], directory: str | Path) -> Path:
    """Write fp32 weights as an HF save_pretrained directory (config.json + model.safetensors)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    state = {}
    for unit, tile in tiles:
        state.update({k: v.clone() for k, v in tile_tensors(spec, unit, tile).items()})
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    spec.hf_config.save_pretrained(root)
    return root
