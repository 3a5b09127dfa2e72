"""Stateless HF layer templates: each unit's weights are bound per call as views of its flat vector.

The engine never owns weights (megatrain/step/engine.py); it runs the family's own modules, built once on
the meta device, through torch.func.functional_call. Here too: the routers' hooks of a mixture of experts
(megatrain/layers/moe.py), token tiles (megatrain/step/tiling.py) and lean layers (megatrain/step/lean.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.func import functional_call

from megatrain.errors import ConfigError
from megatrain.layers.documents import LayerContext
from megatrain.layers.moe import RouterStats, moe_info
from megatrain.model.spec import ModelSpec, meta_model, with_experts
from megatrain.step.lean import experts_rerun, lean_call
from megatrain.step.tiling import tileable, tiled_layer


class Templates:
    """Stateless HF modules on the meta device; weights are bound per call as views of a flat vector."""

    def __init__(self, spec: ModelSpec, device: torch.device, experts: str = "hf"):
        model = meta_model(spec.family, with_experts(spec.hf_config, experts))  # engine.moe_experts
        self.spec, self.layout = spec, spec.layout
        types = getattr(spec.hf_config, "layer_types", None)
        cache: dict[tuple, torch.nn.Module] = {}
        self.layers: dict[int, torch.nn.Module] = {}
        for i, layer in enumerate(model.model.layers):
            u = self.layout.units[i + 1]
            key = (u.structure, types[i] if types else None)
            self.layers[u.index] = cache.setdefault(key, layer)
        self.norm = model.model.norm
        with torch.device(device):  # transformers versions differ on whether __init__ takes device=
            self.rotary = type(model.model.rotary_emb)(config=spec.hf_config)
        self.pad_id = getattr(spec.hf_config, "pad_token_id", None)
        self.tile = 0  # tokens per tile of a layer's MLP half (megatrain/step/tiling.py); 0 = untiled
        self.moe = self._router_stats(model, device)
        self.lean = functools.partial(lean_call, save_grouped=not experts_rerun(self.layout))  # megatrain/step/lean.py

    def _router_stats(self, model: torch.nn.Module, device: torch.device) -> RouterStats | None:
        """Router statistics hooked into every router of the layer templates (megatrain/layers/moe.py); None for
        a dense model."""
        info = moe_info(model)
        if info is None:
            return None
        routed = {u for u, layer in self.layers.items() if any(isinstance(m, info.router) for m in layer.modules())}
        stats = RouterStats(info, sorted(routed), device)
        templates = {id(layer): layer for layer in self.layers.values()}.values()
        for m in (m for layer in templates for m in layer.modules() if isinstance(m, info.router)):
            m.register_forward_hook(stats.hook)
        return stats

    def use_tiles(self, tile: int) -> None:
        if tile and not all(tileable(layer) for layer in self.layers.values()):
            raise ConfigError(
                f"engine.token_tile: {self.spec.family} layers do not have the pre-norm residual "
                f"shape a tiled layer reproduces (megatrain/step/tiling.py); set engine.token_tile: 0"
            )
        self.tile = tile

    def views(self, unit: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's tensors as views of its flat vector, made by one split: its backward writes the
        flat gradient in one concatenation, where per-tensor slices would each add a full-size one."""
        sizes, slots, used = self._splits(self.layout.units[unit].structure)
        if flat.numel() > used:  # a padded tile
            sizes = [*sizes, flat.numel() - used]
        return {s.name: part.view(s.shape) for s, part in zip(slots, flat.split(sizes)) if s is not None}

    @functools.cache  # noqa: B019 - one entry per structure, for the templates' lifetime
    def _splits(self, structure: str) -> tuple[list[int], list, int]:
        """Split sizes of a structure's flat vector, alignment gaps included (their slot is None)."""
        sizes, slots, pos = [], [], 0
        for s in self.layout.structures[structure].slots:
            if s.offset > pos:
                sizes.append(s.offset - pos)
                slots.append(None)
            sizes.append(s.numel)
            slots.append(s)
            pos = s.offset + s.numel
        return sizes, slots, pos

    def layer(
        self, unit: int, flat: torch.Tensor, x: torch.Tensor, ctx: LayerContext, lean: bool = False
    ) -> torch.Tensor:
        kwargs = ctx.kwargs()
        if self.moe is not None:
            self.moe.unit = unit
        if self.tile and x.shape[0] * x.shape[1] > self.tile:  # the MLP half in tiles; lean covers attention
            return tiled_layer(
                self.layers[unit], self.views(unit, flat), x, self.tile, kwargs, self.lean if lean else None
            )
        if lean:
            return self.lean(self.layer, unit, flat, x, ctx)
        out = functional_call(self.layers[unit], self.views(unit, flat), (x,), kwargs)
        return out[0] if isinstance(out, tuple) else out

    def embed_weight(self, flat: torch.Tensor) -> torch.Tensor:
        return self.views(0, flat)["weight"]

    def head(self, head_flat: torch.Tensor, emb_flat: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        v = self.views(self.layout.num_layers + 1, head_flat)
        normed = functional_call(self.norm, {k[len("norm.") :]: t for k, t in v.items() if k.startswith("norm.")}, (x,))
        return F.linear(normed, self.embed_weight(emb_flat) if self.layout.tied else v["lm_head.weight"])
