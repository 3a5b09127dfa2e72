"""`megatrain-launch plot RUN_DIR`: loss, throughput and the recorded step's timeline, from a real run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatrain.launch.cli import main
from megatrain.launch.config import load_config
from megatrain.launch.driver import Trainer
from megatrain.launch.plots import run_flops, save, throughput_figure, timeline_figure
from tests.helpers import TINY

PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_the_runs_pictures(tmp_path, rid: str, capsys) -> None:
    pytest.importorskip("matplotlib")
    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.hf={hf}",
            "data.seq_len=32",
            "data.batch_size=2",
            "train.steps=4",
            "train.eval_every=2",
            "train.timeline_step=3",
            f"train.run_id={rid}",
            f"train.output_dir={out}",
            "launch.runner=inprocess",
        ],
    )
    summary = Trainer(cfg).run()
    assert main(["plot", str(out)]) == 0
    for name in ("loss.png", "throughput.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name
    assert "timeline.png" in capsys.readouterr().out
    tokens = 2 * 32  # TFLOPS from the run's config.yaml: (6ND + 12LHSD) per step
    flops = run_flops(out)
    assert flops == 6 * summary["num_params"] * tokens + 12 * 2 * TINY["hidden_size"] * 32 * tokens

    # What the pictures hold, on the figures written: tokens/s and TFLOPS in panels of their own, over the
    # same steps; every colour of the timeline named in its legend.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    fig = throughput_figure(rows, flops)
    tokens_ax, tflops_ax = fig.axes
    assert tokens_ax.get_ylabel() == "tokens/s" and tflops_ax.get_ylabel().startswith("TFLOPS")
    (tok_line,), (tf_line,) = tokens_ax.get_lines(), tflops_ax.get_lines()
    assert list(tok_line.get_ydata()) == [r["tokens_per_s"] for r in rows]
    assert list(tf_line.get_ydata()) == pytest.approx([flops / r["step_time_s"] / 1e12 for r in rows])
    assert list(tf_line.get_xdata()) == list(tok_line.get_xdata()) == [1, 2, 3, 4]
    lo, hi = tokens_ax.get_ylim()  # each line scaled to its own panel, not drawn over the other
    assert lo <= min(tok_line.get_ydata()) and max(tok_line.get_ydata()) <= hi
    save(fig, tmp_path / "t.png")

    timeline = json.loads((out / "timeline.json").read_text())  # a CPU step: no H2D or D2H lane
    assert legend_of(timeline_figure(timeline, "step 3"), tmp_path) == [
        "compute: forward",
        "compute: norm, LM head and loss",
        "compute: backward",
        "compute: embedding backward",
        "CPU Adam",
    ]
    (out / "timeline.json").unlink()
    elsewhere = tmp_path / "pictures"
    assert main(["plot", str(out), "--out", str(elsewhere)]) == 0
    assert sorted(p.name for p in elsewhere.iterdir()) == ["loss.png", "throughput.png"]


def legend_of(fig, where: Path) -> list[str]:
    """The legend's names, after checking that it names every colour drawn and no other."""
    legend = fig.axes[0].get_legend()
    drawn = {tuple(round(c, 3) for c in bar.get_facecolor()[0]) for bar in fig.axes[0].collections}
    named = [tuple(round(c, 3) for c in patch.get_facecolor()) for patch in legend.get_patches()]
    assert drawn == set(named) and len(named) == len(set(named))
    names = [t.get_text() for t in legend.get_texts()]
    save(fig, where / "timeline.png")
    return names


def test_a_gpu_steps_timeline_names_every_lane_and_kind(tmp_path) -> None:
    """A GPU step's timeline.json (units streamed in and out, recompute before backward)."""
    pytest.importorskip("matplotlib")
    compute = [
        ("forward", 0.0),
        ("fwd:0", 0.0),
        ("fwd:1", 0.1),
        ("head", 0.2),
        ("recompute:1", 0.3),
        ("bwd:1", 0.35),
        ("bwd:0", 0.45),
        ("embed-bwd", 0.5),
        ("end", 0.55),
    ]
    tl = {
        "wall0": 10.0,
        "compute": compute,
        "h2d": [[0, 0.0, 0.05], [1, 0.05, 0.1]],
        "d2h": [[1, 0.45, 0.5], [0, 0.5, 0.55]],
        "adam": [[1, 10.5, 10.6], [0, 10.6, 10.7]],
        "step": 3,
    }
    assert legend_of(timeline_figure(tl, "step 3"), tmp_path) == [
        "H2D weights",
        "compute: forward",
        "compute: norm, LM head and loss",
        "compute: recompute",
        "compute: backward",
        "compute: embedding backward",
        "D2H grads",
        "CPU Adam",
    ]


def test_plot_of_a_directory_that_is_no_run_is_a_usage_error(tmp_path, capsys) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no metrics.jsonl" in err and str(tmp_path) in err


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.0, "tokens_per_s": 1.0, "step_time_s": 1.0}) + "\n"
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plotting needs matplotlib" in err and "pip install matplotlib" in err


def test_matplotlib_is_installed_with_megatrain() -> None:
    """The default set-up installs the project's dependencies: `plot` works without an extra."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from tests.conftest import ROOT

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("matplotlib") for d in deps)
