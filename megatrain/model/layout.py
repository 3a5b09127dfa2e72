"""Where every parameter lives in the host store: units, tiles, slots.

A *unit* is what streams as one piece: the embedding (unit 0), each decoder layer (1..N) and the
head (final norm + LM head, unit N+1). Each unit owns one contiguous tile in every plane of the
store (fp32 params, m, v, grads), aligned so that both fp32 and bf16 views start on 4 KiB pages.
A *structure* (the tensors of a unit with their shapes and offsets) is shared by all units of the
same shape, so N decoder layers carry one structure. With tied embeddings the head holds only the
norm; the LM head reads the embedding's tile, so the tied matrix exists once.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

TILE_ALIGN = 2048  # elements: 8 KiB of fp32, 4 KiB of bf16
# The store's fp32 planes, each with every unit's tile: the state (what a checkpoint holds: master weights and
# Adam's moments), then the gradient plane, which a store has only with clipping in slabs mode
# (megatrain/memory/host.py StoreShape.planes).
STATE_PLANES = ("params", "exp_avg", "exp_avg_sq")
PLANES = (*STATE_PLANES, "grads")
SLOT_ALIGN = 16  # elements: 64-byte aligned tensors inside a tile (vector loads)


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class Slot:
    name: str  # relative to the unit's HF prefix, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int  # elements from the start of the unit's tile
    decay: bool  # weight decay applies (matrices yes; norms and biases no, when configured)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Structure:
    slots: tuple[Slot, ...]
    numel: int  # elements actually used (the tile may be padded beyond)

    @classmethod
    def pack(cls, tensors: list[tuple[str, tuple[int, ...], bool]]) -> Structure:
        # Decayed tensors first, then the rest: the optimizer then covers each group in one run.
        ordered = sorted(tensors, key=lambda t: not t[2])
        slots, off = [], 0
        for name, shape, decay in ordered:
            off = round_up(off, SLOT_ALIGN)
            slots.append(Slot(name, tuple(shape), off, decay))
            off += math.prod(shape)
        return cls(tuple(slots), off)

    def decay_split(self) -> int:
        """Elements [0, split) take weight decay, [split, numel) do not (decayed slots come first)."""
        return next((s.offset for s in self.slots if not s.decay), self.numel)


@dataclass(frozen=True)
class Unit:
    index: int
    kind: str  # "embed" | "layer" | "head"
    prefix: str  # HF state-dict prefix, e.g. "model.layers.3."
    structure: str  # key into StoreLayout.structures
    offset: int  # elements from the start of each plane's data area
    tile: int  # padded tile size in elements


@dataclass(frozen=True)
class StoreLayout:
    units: tuple[Unit, ...]
    structures: dict[str, Structure]
    total: int  # elements per plane
    tied: bool  # LM head reads the embedding tile
    hf_names: dict[str, str]  # HF name of a slot outside its unit prefix (e.g. lm_head.weight)

    @property
    def num_layers(self) -> int:
        return len(self.units) - 2

    @property
    def num_params(self) -> int:
        """The model's parameters: every slot's elements, not the alignment gaps between slots."""
        return sum(s.numel for u in self.units for s in self.structures[u.structure].slots)

    @property
    def max_unit_numel(self) -> int:
        return max(self.structures[u.structure].numel for u in self.units)

    def structure_of(self, unit: int) -> Structure:
        return self.structures[self.units[unit].structure]

    def hf_name(self, unit: int, slot: str) -> str:
        u = self.units[unit]
        return self.hf_names.get(f"{u.index}:{slot}", u.prefix + slot)

    def digest(self) -> bytes:
        """16-byte hash checked on every attach, so a process never reads a store of another shape."""
        blob = json.dumps(
            {
                "units": [(u.kind, u.prefix, u.structure, u.offset, u.tile) for u in self.units],
                "structures": {k: [(s.name, s.shape, s.offset) for s in v.slots] for k, v in self.structures.items()},
                "tied": self.tied,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).digest()[:16]


def build_layout(
    unit_tensors: list[tuple[str, str, list[tuple[str, tuple[int, ...], bool]]]], tied: bool, hf_names: dict[str, str]
) -> StoreLayout:
    """unit_tensors: per unit (kind, prefix, [(name, shape, decay)]) in unit order."""
    structures: dict[str, Structure] = {}
    units, off = [], 0
    for index, (kind, prefix, tensors) in enumerate(unit_tensors):
        st = Structure.pack(tensors)
        key = f"{kind}:" + hashlib.sha1(repr(st.slots).encode()).hexdigest()[:10]
        structures.setdefault(key, st)
        tile = round_up(max(st.numel, 1), TILE_ALIGN)
        units.append(Unit(index, kind, prefix, key, off, tile))
        off += tile
    return StoreLayout(tuple(units), structures, off, tied, hf_names)
