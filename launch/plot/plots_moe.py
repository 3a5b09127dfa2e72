"""experts.png of `megatrain-launch plot`, for a mixture-of-experts run: where its routers send the tokens, so
that routing collapse (a layer's tokens piling onto a few experts while others starve) shows.

From the rows of metrics.jsonl that carry `expert_load` (per MoE layer, the top-k assignments each expert
took in the step: RouterStats.load() in megatrain/layers/moe.py) and `aux_loss`:

  top     heat map, MoE layer x expert: each expert's share of its layer's assignments over the last
          HEAT_STEPS logged steps. Uniform routing reads 1/E in every cell, where the diverging colour
          scale is white: red cells are overloaded experts, blue ones starved.
  middle  per step and MoE layer, the busiest expert's share over the uniform 1/E: 1 is even routing, E/k
          (every token's k choices on the same k experts) full collapse.
  bottom  aux_loss per step (HF's load-balancing loss, before router_aux_loss_coef), where rows carry it.

A dense run's rows carry neither key: routing() gives None and no experts.png is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.errors import ConfigError
from megatrain.launch.plot.figures import pyplot, span

HEAT_STEPS = 10  # one step's batch is noisy on a small run; a few pooled show where routing has settled
ANNOTATE_CELLS = 64  # up to this many cells the heat map prints each share; beyond, the numbers crowd
LEGEND_LAYERS = 12  # up to this many MoE layers get a legend entry each; beyond, a colour bar by layer


@dataclass(frozen=True)
class Routing:
    """The expert loads of a run's MoE rows, checked: one shape across steps."""

    steps: list[int]  # the steps whose rows carry expert_load
    load: np.ndarray  # tokens (top-k assignments) per [step, MoE layer, expert]
    aux: list[tuple[int, float]]  # (step, aux_loss) of the rows that carry it


def step_load(row: dict, source: Path) -> np.ndarray:
    """One row's expert_load as [layer, expert] counts; a ConfigError naming the row when it is not a
    non-empty list of equal-length lists of non-negative numbers (plot's other bad input is one line too)."""
    load, why = row["expert_load"], ""
    if not isinstance(load, list) or not load or not all(isinstance(layer, list) for layer in load):
        why = f"got {type(load).__name__} {str(load)[:60]}"
    elif len({len(layer) for layer in load}) != 1 or not load[0]:
        why = "got layers of " + ", ".join(str(len(layer)) for layer in load) + " experts"
    else:
        try:
            counts = np.asarray(load, dtype=float)
        except (TypeError, ValueError):
            counts = np.array([np.nan])
        if not (np.isfinite(counts).all() and (counts >= 0).all()):
            why = "got counts that are not all non-negative numbers"
    if why:
        raise ConfigError(
            f"plot: {source} step {row.get('step', '?')}: expert_load must be, per MoE layer, a list of "
            f"the tokens routed to each expert, every layer with the same number of experts ({why})"
        )
    return counts


def routing(rows: list[dict], source: Path) -> Routing | None:
    """The run's routing from its metrics rows; None for a dense run (no row carries expert_load)."""
    moe = [r for r in rows if "expert_load" in r]
    if not moe:
        return None
    loads = [step_load(r, source) for r in moe]
    for r, load in zip(moe, loads):
        # A run keeps its model: a shape that changes between steps means the file mixes runs.
        if load.shape != loads[0].shape:
            raise ConfigError(
                f"plot: {source} step {r.get('step', '?')}: expert_load is {load.shape[0]} layers x "
                f"{load.shape[1]} experts, step {moe[0].get('step', '?')}'s {loads[0].shape[0]} x "
                f"{loads[0].shape[1]} (rows of different runs?)"
            )
    aux = []
    for r in rows:
        if "aux_loss" in r:
            if isinstance(r["aux_loss"], bool) or not isinstance(r["aux_loss"], (int, float)):
                raise ConfigError(f"plot: {source} step {r.get('step', '?')}: aux_loss is not a number")
            aux.append((r["step"], float(r["aux_loss"])))
    return Routing([r["step"] for r in moe], np.stack(loads), aux)


def shares(load: np.ndarray) -> np.ndarray:
    """Counts normalised over the last axis (experts) per layer; NaN where a layer routed nothing, so an
    empty layer reads as missing instead of as perfectly starved."""
    total = load.sum(axis=-1, keepdims=True)
    return np.divide(load, total, out=np.full(load.shape, np.nan), where=total > 0)


def heat_panel(fig: Any, ax: Any, r: Routing) -> None:
    """Share per MoE layer and expert over the last HEAT_STEPS steps, pooled (token-weighted) before
    normalising; the colour scale's centre, white, is the uniform 1/E."""
    from matplotlib.colors import Normalize, TwoSlopeNorm

    share = shares(r.load[-HEAT_STEPS:].sum(axis=0))
    layers, experts = share.shape
    uniform = 1.0 / experts
    top = min(1.0, max(2 * uniform, float(np.nan_to_num(share).max())))
    # TwoSlopeNorm needs vmin < vcenter < vmax: a single expert (uniform = 1) gets a plain scale.
    norm = TwoSlopeNorm(vcenter=uniform, vmin=0.0, vmax=top) if experts > 1 else Normalize(0.0, 1.0)
    image = ax.imshow(share, cmap="RdBu_r", norm=norm, aspect="auto", interpolation="nearest")
    if share.size <= ANNOTATE_CELLS:
        for (layer, expert), value in np.ndenumerate(share):
            # White on the deep ends of the scale, where black text would vanish.
            colour = "white" if abs(float(norm(value)) - 0.5) > 0.3 else "black"
            ax.text(expert, layer, f"{value:.2f}", ha="center", va="center", fontsize="small", color=colour)
    bar = fig.colorbar(image, ax=ax, label="share of the layer's tokens")
    bar.set_ticks(sorted({0.0, uniform, top}))
    bar.set_ticklabels([f"{t:.2g}" + (" = 1/E" if t == uniform else "") for t in sorted({0.0, uniform, top})])
    pooled = span(r.steps[-HEAT_STEPS:])
    ax.set_title(f"token share per expert, {pooled} (uniform: 1/E = {uniform:.3g}, white)")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    if experts <= 32:
        ax.set_xticks(range(experts))
    if layers <= 32:
        ax.set_yticks(range(layers))


def collapse_panel(fig: Any, ax: Any, r: Routing) -> None:
    """Per step, each MoE layer's busiest expert's share over 1/E: 1 is even, E/k all tokens on k experts."""
    plt = pyplot()
    from matplotlib.colors import ListedColormap

    ratio = shares(r.load).max(axis=2) * r.load.shape[2]  # [step, layer]; NaN stays NaN (a gap)
    layers = ratio.shape[1]
    # One colour per layer, dark to light; viridis stops at 0.9 so the last layer is not a pale yellow.
    colours = ListedColormap(plt.get_cmap("viridis")(np.linspace(0.0, 0.9, layers)))
    marker = "." if len(r.steps) <= 50 else None  # a run of a few steps would otherwise show short stubs
    for layer in range(layers):
        ax.plot(r.steps, ratio[:, layer], color=colours(layer), marker=marker, linewidth=1, label=f"layer {layer}")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="uniform")
    ax.set_ylabel("busiest expert's\nshare x E")
    ax.grid(alpha=0.3)
    if layers <= LEGEND_LAYERS:
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small", title="MoE layer")
    else:  # a legend of dozens of layers would be taller than the figure
        mappable = plt.cm.ScalarMappable(cmap=colours, norm=plt.Normalize(-0.5, layers - 0.5))
        fig.colorbar(mappable, ax=ax, label="MoE layer")


def aux_panel(ax: Any, r: Routing) -> None:
    steps, values = zip(*r.aux)
    ax.plot(steps, values, color="tab:red", linewidth=1, marker="." if len(steps) <= 50 else None)
    ax.set_ylabel("aux_loss\n(before coef)")
    ax.grid(alpha=0.3)


def experts_figure(r: Routing, title: str) -> Any:
    """The three panels (two without aux_loss); the heat map grows with the number of MoE layers."""
    plt = pyplot()
    layers = r.load.shape[1]
    heights = [min(8.0, 1.5 + 0.3 * layers), 2.8] + ([2.0] if r.aux else [])
    fig = plt.figure(figsize=(11, sum(heights) + 1.2), layout="constrained")
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    heat_panel(fig, fig.add_subplot(grid[0]), r)
    collapse = fig.add_subplot(grid[1])
    collapse_panel(fig, collapse, r)
    if r.aux:
        aux = fig.add_subplot(grid[2], sharex=collapse)
        aux_panel(aux, r)
        collapse.tick_params(labelbottom=False)
        aux.set_xlabel("step")
    else:
        collapse.set_xlabel("step")
    fig.suptitle(f"{title}, {span(r.steps)}: routing of {layers} MoE layers x {r.load.shape[2]} experts")
    return fig
