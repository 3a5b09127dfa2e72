"""`megatrain-launch plot RUN_DIR`: a run's pictures from its output directory.

Every figure's title names the run (its config.yaml's train.run_id) and the steps drawn.

  loss.png        training loss per step, the evaluation loss where the run evaluated, and on a second
                  axis the evaluation's exact-match accuracy where it was logged (the arithmetic data)
  throughput.png  tokens/s and TFLOPS per step, one panel each (TFLOPS from the run's config.yaml)
  timeline.png    the recorded step (train.timeline_step): lanes for H2D, compute, D2H and CPU Adam, per
                  unit, as in the paper's Figure 3, with a legend for the colours
  experts.png     mixture of experts only (rows with expert_load): a heat map of each expert's share of its
                  layer's tokens (uniform is 1/E), per step each MoE layer's busiest expert over 1/E (routing
                  collapse) and the aux_loss; drawn by plots_moe.py

matplotlib is installed with megatrain; where it is missing anyway the command says how to get it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from megatrain.errors import ConfigError
from megatrain.launch.plot.figures import pyplot, span
from megatrain.launch.plot.plots_moe import experts_figure, routing

# The compute lane's colours, by the kind of span (the mark's name before ':'), with their legend names.
COMPUTE_KINDS = {
    "fwd": ("tab:blue", "forward"),
    "head": ("tab:red", "norm, LM head and loss"),
    "recompute": ("tab:cyan", "recompute"),
    "bwd": ("tab:orange", "backward"),
    "embed-bwd": ("tab:brown", "embedding backward"),
}
OTHER = ("tab:gray", "other")
ACCURACY = "eval exact-match accuracy"  # eval_accuracy in metrics.jsonl (megatrain/data/arithmetic.py)
LANES = (("H2D weights", "tab:green"), ("compute", None), ("D2H grads", "tab:purple"), ("CPU Adam", "tab:olive"))


def compute_spans(marks: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """Consecutive marks become (label, start, end) spans; phase marks only bound them."""
    spans = []
    for (name, t0), (_, t1) in zip(marks, marks[1:]):
        if name not in ("forward", "end"):
            spans.append((name, t0, t1))
    return spans


def save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def timeline_figure(tl: dict, title: str) -> Any:
    """One lane per stream of the recorded step; the compute lane coloured by kind, with a legend that names
    every colour drawn."""
    plt = pyplot()
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(16, 4.5))
    spans = {
        "H2D weights": [(f"u{u}", a, b) for u, a, b in tl.get("h2d", [])],
        "compute": compute_spans(tl["compute"]),
        "D2H grads": [(f"u{u}", a, b) for u, a, b in tl.get("d2h", [])],
        "CPU Adam": [(f"u{u}", a - tl["wall0"], b - tl["wall0"]) for u, a, b in tl.get("adam", [])],
    }
    drawn: set[tuple[str, str]] = set()  # (legend name, colour)
    for y, (lane, color) in enumerate(reversed(LANES)):
        for label, a, b in spans[lane]:
            c, name = (color, lane) if color else COMPUTE_KINDS.get(label.split(":")[0], OTHER)
            ax.broken_barh([(a, max(b - a, 1e-4))], (y - 0.4, 0.8), color=c, edgecolor="black", linewidth=0.3)
            drawn.add((name if color else f"compute: {name}", c))
    ax.set_yticks(range(len(LANES)), [lane for lane, _ in reversed(LANES)])
    # The legend top to bottom as the lanes are, the compute kinds in the order a step runs them.
    order = [LANES[0], *((f"compute: {n}", c) for c, n in (*COMPUTE_KINDS.values(), OTHER)), *LANES[2:]]
    ax.set_xlabel(
        "seconds from the step's first kernel (Adam: wall clock of the same step's update, which "
        "overlaps the next step)"
    )
    ax.set_title(title)
    ax.legend(
        handles=[Patch(facecolor=c, edgecolor="black", label=n) for n, c in order if (n, c) in drawn],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize="small",
        title="colours",
    )
    fig.tight_layout()
    return fig


def plot_timeline(tl: dict, path: Path, title: str) -> None:
    """timeline_figure written to `path` (bench/run.py draws each benchmark's step with it)."""
    save(timeline_figure(tl, title), path)


def heading(run_id: str, rows: list[dict]) -> str:
    """A figure's title: the run and the steps its rows cover."""
    return f"run {run_id}, {span([r['step'] for r in rows])}"


def loss_figure(rows: list[dict], run_id: str) -> Any:
    """Training loss per step, the evaluation loss where the run evaluated, and on a second axis the
    evaluation's exact-match accuracy where it was logged (eval_accuracy: the bundled arithmetic data)."""
    plt = pyplot()
    from matplotlib.ticker import PercentFormatter

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss", linewidth=1)
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    handles = ax.get_legend_handles_labels()[0]
    scored = [r for r in rows if "eval_accuracy" in r]
    if scored:  # a fraction in [0, 1], on an axis of its own: the loss's scale would flatten it
        acc = ax.twinx()
        acc.plot(
            [r["step"] for r in scored],
            [r["eval_accuracy"] for r in scored],
            "s--",
            color="tab:green",
            label=ACCURACY,
        )
        acc.set_ylim(-0.02, 1.02)
        acc.yaxis.set_major_formatter(PercentFormatter(1.0))
        acc.set_ylabel(ACCURACY)
        handles += acc.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper center")
    ax.grid(alpha=0.3)
    ax.set_title(heading(run_id, rows))
    fig.tight_layout()
    return fig


def throughput_figure(rows: list[dict], flops_per_step: float | None, run_id: str) -> Any:
    """tokens/s and, where the run's useful work per step is known, TFLOPS: one panel each over the same
    steps (on one pair of axes the second line's scale put it over the first)."""
    plt = pyplot()
    panels = 2 if flops_per_step else 1
    fig, axes = plt.subplots(panels, 1, figsize=(9, 2.6 + 2.4 * panels), sharex=True, squeeze=False)
    steps = [r["step"] for r in rows]
    top = axes[0][0]
    top.plot(steps, [r["tokens_per_s"] for r in rows], color="tab:blue", linewidth=1, label="tokens/s")
    top.set_ylabel("tokens/s")
    if flops_per_step:
        low = axes[1][0]
        low.plot(
            steps,
            [flops_per_step / r["step_time_s"] / 1e12 for r in rows],
            color="tab:red",
            linewidth=1,
            label="TFLOPS",
        )
        low.set_ylabel("TFLOPS\n(6ND + 12LHSD) / t")
    for (ax,) in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[-1][0].set_xlabel("step")
    axes[0][0].set_title(heading(run_id, rows))
    fig.tight_layout()
    return fig


def run_id_of(run_dir: Path) -> str:
    """The run id its config.yaml records (train.run_id, the last launch's on a resumed run); the
    directory's name where that cannot be read."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        rid = (cfg.get("train") or {}).get("run_id") if isinstance(cfg, dict) else None
    except (OSError, ValueError, yaml.YAMLError):
        rid = None
    return str(rid) if rid else run_dir.resolve().name


def run_flops(run_dir: Path) -> float | None:
    """Useful work per step of the run, from its config.yaml; None when that cannot be read."""
    from megatrain.flops import model_step_flops
    from megatrain.launch.config.tree import load_config
    from megatrain.model.spec import build_spec

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
    moe = routing(rows, metrics)  # None for a dense run; checked before any picture is written
    out.mkdir(parents=True, exist_ok=True)
    rid = run_id_of(run)
    written = [out / "loss.png", out / "throughput.png"]
    save(loss_figure(rows, rid), written[0])
    save(throughput_figure(rows, run_flops(run), rid), written[1])
    if (run / "timeline.json").is_file():
        tl = json.loads((run / "timeline.json").read_text())
        written.append(out / "timeline.png")
        save(timeline_figure(tl, f"run {rid}, step {tl.get('step', '?')}"), written[-1])
    if moe is not None:
        written.append(out / "experts.png")
        save(experts_figure(moe, f"run {rid}"), written[-1])
    print("megatrain-launch plot: wrote " + ", ".join(str(w) for w in written))
    return 0
