"""`megatrain-launch export CHECKPOINT_DIR|RUN_DIR OUT_DIR [--dtype bf16|fp32]`: a checkpoint's weights as
an HF save_pretrained directory, streamed unit by unit from the memory-mapped checkpoint files (each unit
put together from every host's part of it: one host's checkpoint has one part)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatrain.errors import ConfigError, DataError, MegatrainError, disk_full, is_disk_full

# megatrain/formats/export.py's DTYPES (tests/test_light_launcher.py holds them equal): named here, so that
# `export --help` and a mistyped flag need no torch; the export's own imports come in run().
DTYPE_NAMES = ("bf16", "fp32")
_NOT_FIELDS = ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatrain-launch export", description="Write a checkpoint's weights as an HF save_pretrained directory."
    )
    p.add_argument("source", help="a checkpoint directory, or a run's output directory (its newest checkpoint)")
    p.add_argument("out", help="the HF directory to write")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32")
    p.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors shard, in GB (default 5)")
    return p


def run(source: str, out: str, dtype: str = "fp32", shard_gb: float = 5.0) -> tuple[Path, dict]:
    """Export SOURCE's checkpoint into OUT: (OUT, what RECORD says of the checkpoint: step, path, run id)."""
    import numpy as np
    import torch
    import yaml

    from megatrain.formats import checkpoint as ckpt
    from megatrain.formats.export import export
    from megatrain.launch.prepare.resume import find_checkpoint
    from megatrain.model.spec import ModelConfig, build_spec

    _check_target(Path(out))
    src = _no_checkpoint_run(Path(source)) or find_checkpoint(source, Path(source), key="SOURCE")
    if src is None:
        raise ConfigError(f"SOURCE '{source}' holds no complete checkpoint")
    manifest = ckpt.manifest_of(src)
    run_cfg = yaml.safe_load(manifest.get("config", "")) or {}
    hf = {k: v for k, v in manifest["hf_config"].items() if k not in _NOT_FIELDS}
    spec = build_spec(ModelConfig(family=manifest["family"], hf=hf), run_cfg.get("optim", {}).get("no_decay_1d", True))
    if spec.layout.digest().hex() != manifest["layout_hash"]:
        raise ConfigError(f"{src} does not match the model its manifest describes (layout hash)")
    # Each host's part holds its slice of every unit (its files, `slices`: lo, hi, offset; one host: every unit).
    parts = ckpt.part_files(manifest)
    slices = [part_slices for _, part_slices in parts]
    files = []
    for names, _ in parts:
        problem = ckpt.verify_file(src, names["params"], lambda off: ckpt.unit_at(spec.layout, off), manifest)
        if problem:  # the weights are what is exported: every byte of them is checked first
            raise ConfigError(f"{problem}; export another checkpoint of the run (a step-N directory)")
        files.append(np.memmap(src / names["params"], dtype=np.float32, mode="r"))  # read as units are written

    def tile(u: int) -> torch.Tensor:
        whole = np.empty(spec.layout.structure_of(u).numel, np.float32)
        for params, part in zip(files, slices, strict=True):
            lo, hi, at = part[u]
            whole[lo:hi] = params[at : at + hi - lo]
        return torch.from_numpy(whole)

    record = {"step": int(manifest["step"]), "checkpoint": str(src.resolve())}
    record["run_id"] = (run_cfg.get("train") or {}).get("run_id")
    path = export(spec, tile, out, dtype, int(shard_gb * 1e9), run=run_cfg, record=record)
    return path, record


def _no_checkpoint_run(source: Path) -> None:
    """A run's output directory that holds no checkpoint (a run saves one only when told to): a usage error
    saying which settings write one, and where the HF model already is when the run wrote it."""
    if not (source / "metrics.jsonl").is_file() or _holds_checkpoint(source):
        return None
    final = source / "final"
    if (final / "config.json").is_file():
        hint = f"its {final} is already an HF directory (train.save_final)"
    else:
        hint = (
            "train.save_every=N writes one every N steps and after the last, and train.save_final=true writes "
            "OUTPUT_DIR/final/, an HF directory, at the end; a run stopped by Ctrl-C writes one too"
        )
    raise ConfigError(f"SOURCE '{source}' is a run's output directory with no checkpoint: the run saved none; {hint}")


def _holds_checkpoint(run_dir: Path) -> bool:
    from megatrain.formats import checkpoint as ckpt

    return ckpt.latest(run_dir / "checkpoints") is not None


def _check_target(out: Path) -> None:
    """OUT is a new directory, or an empty one: an export never mixes its files with another model's."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT '{out}' exists and is not a directory; name a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"OUT '{out}' is not empty; name a new directory (or remove that one)")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        path, record = run(args.source, args.out, args.dtype, args.shard_gb)
    except (ConfigError, DataError) as exc:
        print(f"megatrain-launch export: error: {exc}", file=sys.stderr)
        return 2
    except MegatrainError as exc:
        print(f"megatrain-launch export: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # writing OUT: a full disk, no permission
        what = (
            str(disk_full(args.out, "the exported model"))
            if is_disk_full(exc)
            else (f"cannot write {exc.filename or args.out}: {exc.strerror or exc}")
        )
        print(f"megatrain-launch export: error: {what}", file=sys.stderr)
        return 1
    print(f"megatrain-launch export: wrote {path}: step {record['step']}, from {record['checkpoint']}")
    return 0
