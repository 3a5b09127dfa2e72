"""`megatrain-launch plot RUN_DIR`: a run's pictures from its output directory.

  loss.png        training loss per step, and the evaluation loss where the run evaluated
  throughput.png  tokens/s and TFLOPS per step (TFLOPS from the run's config.yaml)
  timeline.png    the recorded step (train.timeline_step): lanes for H2D, compute, D2H and CPU Adam, per
                  unit, as in the paper's Figure 3

matplotlib is an optional extra (pip install 'megatrain[plot]'); without it the command says so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from megatrain.errors import ConfigError

LANE_COLORS = {"fwd": "tab:blue", "recompute": "tab:cyan", "bwd": "tab:orange", "head": "tab:red",
               "forward": "tab:gray", "embed-bwd": "tab:brown", "end": "tab:gray"}


def compute_spans(marks: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """Consecutive marks become (label, start, end) spans; phase marks only bound them."""
    spans = []
    for (name, t0), (_, t1) in zip(marks, marks[1:]):
        if name not in ("forward", "end"):
            spans.append((name, t0, t1))
    return spans


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only); a ConfigError when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'megatrain[plot]' (or pip install matplotlib)"
                          ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(tl: dict, path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(16, 4))
    lanes = [("H2D weights", [(f"u{u}", a, b) for u, a, b in tl.get("h2d", [])], "tab:green"),
             ("compute", compute_spans(tl["compute"]), None),
             ("D2H grads", [(f"u{u}", a, b) for u, a, b in tl.get("d2h", [])], "tab:purple"),
             ("CPU Adam", [(f"u{u}", a - tl["wall0"], b - tl["wall0"]) for u, a, b in tl.get("adam", [])], "tab:olive")]
    for y, (_, spans, color) in enumerate(reversed(lanes)):
        for label, a, b in spans:
            kind = label.split(":")[0]
            ax.broken_barh([(a, max(b - a, 1e-4))], (y - 0.4, 0.8), color=color or LANE_COLORS.get(kind, "tab:gray"),
                           edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), [name for name, _, _ in reversed(lanes)])
    ax.set_xlabel("seconds from the step's first kernel (Adam: wall clock of the same step's update, which "
                  "overlaps the next step)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_losses(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss", linewidth=1)
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(rows: list[dict], flops_per_step: float | None, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["tokens_per_s"] for r in rows], color="tab:blue", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s", color="tab:blue")
    if flops_per_step:
        right = ax.twinx()
        right.plot(steps, [flops_per_step / r["step_time_s"] / 1e12 for r in rows], color="tab:red", linewidth=1)
        right.set_ylabel("TFLOPS (6ND + 12LHSD) / t", color="tab:red")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_flops(run_dir: Path) -> float | None:
    """Useful work per step of the run, from its config.yaml; None when that cannot be read."""
    from megatrain.launch.config import load_config

    from megatrain.flops import model_step_flops
    from megatrain.model import build_spec

    try:
        cfg = load_config(str(run_dir / "config.yaml"), [])
        spec = build_spec(cfg.model, cfg.optim.no_decay_1d)
    except (ConfigError, OSError, ValueError):
        return None
    return model_step_flops(spec, cfg.data.batch_size, cfg.data.seq_len)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatrain-launch plot", description="Write a run's pictures into its directory.")
    p.add_argument("run_dir", help="the run's output directory (train.output_dir)")
    p.add_argument("--out", help="where the pictures go (default: RUN_DIR)")
    args = p.parse_args(argv)
    run, out = Path(args.run_dir), Path(args.out or args.run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"plot: {run} holds no metrics.jsonl (not a run's output directory)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        raise ConfigError(f"plot: {metrics} has no steps yet")
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "loss.png", out / "throughput.png"]
    plot_losses(rows, written[0])
    plot_throughput(rows, run_flops(run), written[1])
    if (run / "timeline.json").is_file():
        tl = json.loads((run / "timeline.json").read_text())
        written.append(out / "timeline.png")
        plot_timeline(tl, written[-1], f"{run.name}: step {tl.get('step', '?')}")
    print("megatrain-launch plot: wrote " + ", ".join(str(w) for w in written))
    return 0
