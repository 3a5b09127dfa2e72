"""Which checkpoint a run starts from (train.resume), checked whole before anything starts or changes: its
model layout is this run's and every byte of it matches its checksum.

A corrupt checkpoint is never loaded. With train.resume: auto the run falls back to the newest intact
checkpoint of its output directory and says so loudly (the corrupt one is moved aside, as
checkpoints/corrupt-step-N, where the run's pruning and later resumes cannot take it for a checkpoint):
the run was going to continue on its own, and the steps since the intact checkpoint are trained again.
A checkpoint named explicitly (train.resume=PATH) is what the user asked for: a corrupt one is refused,
naming the newest intact checkpoint beside it and the exact train.resume=PATH that starts from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatrain import log
from megatrain.errors import ConfigError
from megatrain.formats import checkpoint as ckpt
from megatrain.model.spec import ModelSpec, build_spec


@dataclass(frozen=True)
class Start:
    """Where a run starts: from scratch, or after the step of a verified checkpoint."""

    directory: Path | None = None  # the checkpoint; None: from scratch
    step: int = 0
    in_place: bool = False  # the output directory's own checkpoint: its metrics.jsonl continues
    complete: bool = False  # the run already ended there (its last step, its final weights): nothing to do


def choose_start(cfg: Any, out: Path, steps: int) -> Start:
    """The verified start of a run of `steps` steps in output directory `out` (cfg: the launch Config)."""
    resume = cfg.train.resume
    found = _newest_first(out / "checkpoints") if resume == "auto" else []
    if resume == "none" or (resume == "auto" and not found):
        return Start()  # nothing to verify: the model's structure (its modeling imports) is built later, beside Ray
    spec = build_spec(cfg.model, cfg.optim.no_decay_1d)
    if resume == "auto":
        directory = _newest_intact(out / "checkpoints", found, spec)
    else:
        directory = find_checkpoint(resume, out)
        problem = _problem(directory, spec)
        if problem:
            raise ConfigError(f"train.resume: {problem}; {_alternative(directory, spec)}")
    if directory is None:
        return Start()
    manifest = ckpt.manifest_of(directory)
    _log_changes(manifest, cfg)
    step = int(manifest["step"])
    final_missing = cfg.train.save_final and not (out / "final" / "config.json").is_file()
    return Start(
        directory,
        step,
        in_place=directory.parent.parent.resolve() == out.resolve(),
        complete=step >= steps and not final_missing,
    )


def may_resume(resume: str, out: Path) -> bool:
    """train.resume may start the run from a checkpoint: one is named, or (auto) the output directory has one
    (whether it is intact is choose_start's to find)."""
    return resume != "none" and (resume != "auto" or bool(_newest_first(out / "checkpoints")))


def find_checkpoint(resume: str, out: Path, key: str = "train.resume") -> Path | None:
    """The checkpoint directory `resume` names (unverified), or None (from scratch); `key` names the setting
    in messages."""
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
    raise ConfigError(
        f"{key}: '{resume}' is neither a complete checkpoint nor a directory holding one "
        "(a run's output directory, or its checkpoints/)"
    )


def _newest_intact(root: Path, found: list[Path], spec: ModelSpec) -> Path | None:
    """train.resume: auto. The newest checkpoint of `found` (root's, _newest_first's order) that is whole;
    newer corrupt ones are set aside, loudly. None when there is none at all; a ConfigError when there are
    some and none is whole."""
    bad: list[tuple[Path, str]] = []
    for directory in found:
        problem = _problem(directory, spec)
        if not problem:
            _fell_back(bad, directory)
            return directory
        bad.append((directory, problem))
    if bad:
        raise ConfigError(
            f"train.resume: auto: no checkpoint in {root} is intact ({len(bad)} corrupt; the newest: "
            f"{bad[0][1]}); train.resume=none with train.overwrite=true starts this run again from "
            "scratch"
        )
    return None


def _newest_first(root: Path) -> list[Path]:
    """The complete checkpoints under `root`: the one `latest` names first, then the others, newest first."""
    named = ckpt.latest(root)
    rest = [d for _, d in reversed(ckpt.complete(root)) if d != named]
    return ([named] if named is not None else []) + rest


def _fell_back(bad: list[tuple[Path, str]], good: Path) -> None:
    if not bad:
        return
    step = ckpt.manifest_of(good)["step"]
    for directory, problem in bad:
        aside = ckpt.set_aside(directory)
        log(f"WARNING: {problem}; that checkpoint is not used (moved to {aside})")
    log(
        f"WARNING: resuming from the newest intact checkpoint, {good} (step {step}), not from the corrupt "
        f"{bad[0][0].name}: the steps after {step} are trained again"
    )


def _problem(directory: Path, spec: ModelSpec) -> str:
    """'' when the checkpoint is this model's and whole; else why not (another model is a ConfigError: no
    other checkpoint of the same directory would fit either)."""
    manifest = ckpt.manifest_of(directory)
    if manifest is None:
        return f"{directory} is not a complete checkpoint (no valid manifest.json, or a file it lists is missing)"
    differs = ckpt.layout_difference(manifest, ckpt.unit_table(spec.layout), spec.layout.digest().hex())
    if differs:
        raise ConfigError(f"train.resume: {directory} holds another model: {differs}")
    t0 = time.monotonic()
    problem = ckpt.verify(directory, _where(spec))
    took = time.monotonic() - t0
    if not problem and took > 1:
        size = sum(int(f["bytes"]) for f in manifest["files"].values())
        log(f"checked {directory}: {size / 1e9:.2f} GB, every checksum right, in {took:.1f} s")
    return problem


def _alternative(directory: Path, spec: ModelSpec) -> str:
    """What to resume from instead of the corrupt `directory`: the newest intact checkpoint beside it."""
    for other in _newest_first(directory.parent):
        if other.resolve() != directory.resolve() and not _problem(other, spec):
            step = ckpt.manifest_of(other)["step"]
            return f"the newest intact checkpoint beside it is step {step}: resume from it with train.resume={other}"
    return "no other checkpoint beside it is intact: train.resume=none starts from scratch"


def _where(spec: ModelSpec) -> Callable[[int], str]:
    return lambda offset: ckpt.unit_at(spec.layout, offset)


def _log_changes(manifest: dict, cfg: Any) -> None:
    then = yaml.safe_load(manifest.get("config", "")) or {}
    before = then.get("optim", {})
    now = dict(vars(cfg.optim))
    changed = [f"optim.{k}: {before[k]} -> {now[k]}" for k in now if k in before and _norm(before[k]) != _norm(now[k])]
    if changed:
        log("resuming with changed optimizer settings: " + ", ".join(changed))
    gpus = (then.get("actors") or {}).get("num_gpus", 1)
    if gpus != cfg.actors.num_gpus:
        log(
            f"resuming a run of actors.num_gpus {gpus} with {cfg.actors.num_gpus}: the weights, moments, step and "
            "data order continue exactly; the batch is split otherwise, so the summed gradients may differ in "
            "their last bits (fp32 additions in another order)"
        )


def _norm(v: object) -> object:
    return list(v) if isinstance(v, tuple) else v
