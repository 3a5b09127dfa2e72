"""One step's timeline as a picture: lanes for H2D, compute, D2H and CPU Adam (cf. the paper's Fig. 3)."""

from __future__ import annotations

from pathlib import Path

LANE_COLORS = {"fwd": "tab:blue", "recompute": "tab:cyan", "bwd": "tab:orange", "head": "tab:red",
               "forward": "tab:gray", "embed-bwd": "tab:brown", "end": "tab:gray"}


def compute_spans(marks: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """Consecutive marks become (label, start, end) spans; phase marks only bound them."""
    spans = []
    for (name, t0), (_, t1) in zip(marks, marks[1:]):
        if name not in ("forward", "end"):
            spans.append((name, t0, t1))
    return spans


def plot_timeline(tl: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
