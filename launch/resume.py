"""Which checkpoint a run starts from (train.resume), and whether it fits this run's model."""

from __future__ import annotations

from pathlib import Path

import yaml

from megatrain import checkpoint as ckpt
from megatrain import log
from megatrain.errors import ConfigError
from megatrain.model import build_spec


def find_checkpoint(resume: str, out: Path) -> Path | None:
    """The checkpoint directory to start from, or None (from scratch)."""
    if resume == "none":
        return None
    if resume == "auto":
        return ckpt.latest(out / "checkpoints")
    path = Path(resume)
    if ckpt.manifest_of(path) is not None:
        return path
    for root in (path / "checkpoints", path):
        found = ckpt.latest(root)
        if found is not None:
            return found
    raise ConfigError(f"train.resume: '{resume}' is neither a complete checkpoint nor a directory holding one "
                      "(a run's output directory, or its checkpoints/)")


def check_fits(directory: Path, cfg) -> dict:  # noqa: ANN001 - the launch Config (no import cycle)
    """The checkpoint's manifest, after checking that its model layout is this run's (else a ConfigError
    naming the first difference) and logging the optimizer settings that changed."""
    manifest = ckpt.manifest_of(directory)
    spec = build_spec(cfg.model, cfg.optim.no_decay_1d)
    problem = ckpt.layout_difference(manifest, ckpt.unit_table(spec.layout), spec.layout.digest().hex())
    if problem:
        raise ConfigError(f"train.resume: {directory} holds another model: {problem}")
    then = yaml.safe_load(manifest.get("config", "")) or {}
    before = then.get("optim", {})
    now = {k: v for k, v in vars(cfg.optim).items()}
    changed = [f"optim.{k}: {before[k]} -> {now[k]}" for k in now if k in before and _norm(before[k]) != _norm(now[k])]
    if changed:
        log("resuming with changed optimizer settings: " + ", ".join(changed))
    return manifest


def _norm(v: object) -> object:
    return list(v) if isinstance(v, tuple) else v
