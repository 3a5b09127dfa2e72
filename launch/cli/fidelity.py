"""MegaTrain vs the plain reference, step by step, from identical initial weights.

`python -m megatrain.launch.cli.fidelity CONFIG [key=value ...]` saves a fresh HF model built from the config,
trains it once through the full actor system and once as a plain PyTorch model (torch.optim.AdamW,
bf16 autocast on cuda, fp32 on cpu), and prints the per-step loss difference and the final weight
differences. The tests use the same function on the CPU in fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

from megatrain.data import Batch, open_data
from megatrain.errors import ConfigError, DataError, MegatrainError
from megatrain.formats import hfformat
from megatrain.launch.config.tree import Config, load_config
from megatrain.model.reference import Batches, train_reference
from megatrain.model.spec import family_classes, resolve_hf_config


def save_initial(cfg: Config, directory: Path) -> Path:
    """The config's model with HF's own init (seeded), written with save_pretrained."""
    family, hf = resolve_hf_config(cfg.model)
    torch.manual_seed(cfg.model.init_seed)
    family_classes(family)[1](hf).float().save_pretrained(directory)
    return directory


def weight_diffs(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """(||ours - ref||, ||ref||) per tensor of ours (a tied lm_head is the embedding)."""
    return {
        name: (float(torch.linalg.norm(t.float() - ref[name].float())), float(torch.linalg.norm(ref[name].float())))
        for name, t in ours.items()
    }


def _as_parameters(
    family: str, disk: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The exported tensors under the model's parameter names (experts stored per expert on disk are
    stacked again: megatrain/formats/hfformat.py); a parameter the export does not hold (a tied lm_head) is left out."""
    out = {}
    for name, ref in params.items():
        got = hfformat.read(family, name, tuple(ref.shape), disk, disk.__getitem__)
        if got is not None:
            out[name] = got
    return out


def _ids_labels(b: Batch) -> tuple[torch.Tensor, ...]:
    return (b.ids, b.labels) if b.positions is None else (b.ids, b.labels, b.positions)


def compare(cfg: Config, workdir: Path, batches: Batches | None = None) -> dict:
    """Train `cfg` through the actor system and the plain reference from the same initial weights;
    the reference takes step t's batch from `batches(t)` when given (tests build them by hand), else
    from the run's own data."""
    from safetensors.torch import load_file

    from megatrain.launch.run.driver import Trainer

    init = save_initial(cfg, workdir / "init")
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, pretrained=str(init)),
        train=dataclasses.replace(cfg.train, save_final=True, output_dir=str(workdir / "run")),
    )
    summary = Trainer(cfg).run()
    disk = load_file(Path(summary.output_dir) / "final" / "model.safetensors")
    family, _ = resolve_hf_config(cfg.model)
    model = family_classes(family)[1].from_pretrained(init, torch_dtype=torch.float32)
    model.config._attn_implementation = "sdpa" if model._supports_sdpa else "eager"
    cuda = summary.metrics and "gpu_peak_bytes" in summary.metrics[0]
    data = open_data(cfg.data, model.config, cfg.model.pretrained)
    steps = len(summary.metrics)
    bf16 = bool(cuda) and cfg.engine.compute_dtype != "fp32"
    ref = train_reference(
        model,
        cfg.optim,
        batches or (lambda t: _ids_labels(data.batch(t))),
        steps,
        device="cuda" if cuda else "cpu",
        autocast_bf16=bf16,
        eval_batches=data.eval_batches(cfg.train.eval_batches) if data.has_eval else None,
    )
    ours = _as_parameters(family, disk, ref.state)
    losses = [m["loss"] for m in summary.metrics]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref.losses)]
    return {
        "losses": losses,
        "ref_losses": ref.losses,
        "loss_rel": rel,
        "max_loss_rel": max(rel, default=0.0),
        "aux_losses": [m["aux_loss"] for m in summary.metrics if "aux_loss" in m],
        "ref_aux_losses": ref.aux_losses,
        "grad_norms": [m["grad_norm"] for m in summary.metrics],
        "ref_grad_norms": ref.grad_norms,
        "weights": weight_diffs(ours, ref.state),
        "summary": summary,
        "eval_loss": next((m["eval_loss"] for m in reversed(summary.metrics) if "eval_loss" in m), None),
        "ref_eval_loss": ref.eval_loss,
    }


def main(argv: list[str] | None = None) -> int:
    """The comparison's report; its output, the run's lines among it, without escape codes where stdout and
    stderr are no terminal, and without colours under NO_COLOR, as megatrain-launch's."""
    from megatrain.launch.report import console

    with console.guarded():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatrain.launch.cli.fidelity")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--json", help="also write the report here")
    p.add_argument("--tolerance", type=float, default=0.01, help="max per-step relative loss difference")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        with tempfile.TemporaryDirectory() as tmp:
            rep = compare(cfg, Path(tmp))
    except (ConfigError, DataError) as exc:  # as megatrain-launch: one line, usage error
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    except MegatrainError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 1
    rep.pop("summary")
    for i, (a, b, r) in enumerate(zip(rep["losses"], rep["ref_losses"], rep["loss_rel"])):
        print(f"step {i + 1:3d}  megatrain {a:.5f}  reference {b:.5f}  rel diff {r:.2e}")
    worst = max((d / max(n, 1e-30) for d, n in rep["weights"].values()), default=0.0)
    print(
        f"max per-step loss rel diff {rep['max_loss_rel']:.3e} (tolerance {args.tolerance}); "
        f"max final weight rel diff {worst:.3e}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
    return 0 if rep["max_loss_rel"] <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
