"""`megatrain-launch plot RUN_DIR`: loss, throughput and the recorded step's timeline, from a real run; a
mixture-of-experts run's expert routing, from metrics rows shaped as the executor writes them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatrain.launch.cli.main import main
from megatrain.launch.config.tree import load_config
from megatrain.launch.plot.plots import (
    ACCURACY,
    loss_figure,
    run_flops,
    run_id_of,
    save,
    throughput_figure,
    timeline_figure,
)
from megatrain.launch.plot.plots_moe import experts_figure, routing
from megatrain.launch.run.driver import Trainer
from tests.harness import TINY

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
    assert not (out / "experts.png").exists()  # a dense run: no expert_load, no routing picture
    tokens = 2 * 32  # TFLOPS from the run's config.yaml: (6ND + 12LHSD) per step
    flops = run_flops(out)
    assert flops == 6 * summary.num_params * tokens + 12 * 2 * TINY["hidden_size"] * 32 * tokens

    # What the pictures hold, on the figures written: every title names the run and its steps; the loss
    # with the arithmetic data's exact-match accuracy on an axis of its own, at the steps that evaluated;
    # tokens/s and TFLOPS in panels of their own, over the same steps; every colour of the timeline named in
    # its legend.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert run_id_of(out) == rid
    loss = loss_figure(rows, rid)
    loss_ax, acc_ax = loss.axes
    assert loss_ax.get_title() == f"run {rid}, steps 1-4"
    scored = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in scored] == [2, 4]  # train.eval_every=2
    (acc_line,) = acc_ax.get_lines()
    assert acc_line.get_label() == acc_ax.get_ylabel() == ACCURACY
    assert list(acc_line.get_xdata()) == [2, 4]
    assert list(acc_line.get_ydata()) == [r["eval_accuracy"] for r in scored]
    assert acc_ax.get_ylim() == pytest.approx((-0.02, 1.02))  # a fraction, not on the loss's scale
    assert ACCURACY in [t.get_text() for t in loss_ax.get_legend().get_texts()]
    save(loss, tmp_path / "l.png")
    fig = throughput_figure(rows, flops, rid)
    assert fig.axes[0].get_title() == f"run {rid}, steps 1-4"
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
    drawn = timeline_figure(timeline, f"run {rid}, step 3")
    assert drawn.axes[0].get_title() == f"run {rid}, step 3"
    assert legend_of(drawn, tmp_path) == [
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


E, K, TOKENS = 4, 2, 64  # experts, top-k, tokens per step: each MoE layer makes K * TOKENS assignments


def moe_rows(steps: int = 6) -> list[dict]:
    """Metrics rows of an MoE run as the executor writes them (expert_load: RouterStats.load(), tokens per
    expert per MoE layer): layer 0 routes evenly, layer 1 collapses onto expert 2 until every token sends it
    one of its K choices (TOKENS of K * TOKENS assignments: a share of 1/K, E/K times the uniform 1/E)."""
    rows = []
    for step in range(1, steps + 1):
        even = [33, 31, 32, 32] if step % 2 else [32, 32, 32, 32]
        hot = min(TOKENS, 32 + 8 * (step - 1))
        rest, extra = divmod(K * TOKENS - hot, E - 1)
        collapsing = [rest + extra, rest, hot, rest]
        rows.append(
            {"step": step, "loss": 4.0 - 0.1 * step, "tokens_per_s": 900.0, "step_time_s": 0.07}
            | {"aux_loss": 2.0 + 0.05 * step, "expert_load": [even, collapsing]}
        )
    return rows


def write_run(where: Path, rows: list[dict]) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return where


def axes_by_ylabel(fig, start: str):
    (ax,) = [a for a in fig.axes if a.get_ylabel().startswith(start)]
    return ax


def test_plot_of_a_moe_run_draws_its_expert_routing(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    rows = moe_rows()
    run = write_run(tmp_path / "moe", rows)
    assert main(["plot", str(run)]) == 0
    data = (run / "experts.png").read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    assert "experts.png" in capsys.readouterr().out

    # The heat map: each expert's share of its layer's assignments, pooled over the steps (6 of them, fewer
    # than HEAT_STEPS), so even routing reads 1/E and the collapsed expert its pooled share.
    fig = experts_figure(routing(rows, run / "metrics.jsonl"), "run moe")
    assert fig.get_suptitle() == "run moe, steps 1-6: routing of 2 MoE layers x 4 experts"
    (heat,) = axes_by_ylabel(fig, "MoE layer").get_images()
    pooled = [[sum(r["expert_load"][layer][e] for r in rows) for e in range(E)] for layer in range(2)]
    want = [c / (K * TOKENS * len(rows)) for layer in pooled for c in layer]
    assert heat.get_array().shape == (2, E) and heat.get_array().ravel().tolist() == pytest.approx(want)
    assert heat.get_array()[0].tolist() == pytest.approx([1 / E] * E, abs=0.01)
    assert heat.norm.vcenter == 1 / E  # the diverging scale's white is uniform routing

    # Per step and layer, the busiest expert's share over 1/E: ~1 for the even layer, up to E/K collapsed.
    collapse = axes_by_ylabel(fig, "busiest expert")
    lines = {line.get_label(): line for line in collapse.get_lines()}
    assert list(lines["layer 1"].get_xdata()) == [r["step"] for r in rows]
    assert list(lines["layer 1"].get_ydata()) == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0, 2.0])
    assert max(lines["layer 0"].get_ydata()) == pytest.approx(33 / (K * TOKENS) * E)
    assert list(lines["uniform"].get_ydata()) == [1.0, 1.0]
    (aux,) = axes_by_ylabel(fig, "aux_loss").get_lines()
    assert list(aux.get_ydata()) == [r["aux_loss"] for r in rows]
    save(fig, tmp_path / "experts.png")


def test_many_moe_layers_get_a_colour_bar_by_layer_and_no_aux_panel_without_aux_loss(tmp_path) -> None:
    """A deep model (48 MoE layers x 64 experts): the layers' colours on a bar, not a legend of 48 entries;
    rows without aux_loss: no aux panel."""
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "expert_load": [[K * TOKENS // 64] * 64] * 48} for s in range(1, 4)]
    fig = experts_figure(routing(rows, tmp_path / "metrics.jsonl"), "deep")
    collapse = axes_by_ylabel(fig, "busiest expert")
    assert collapse.get_legend() is None and collapse.get_xlabel() == "step"
    assert [a.get_ylabel() for a in fig.axes if "aux" in a.get_ylabel()] == []
    assert [a.get_ylabel() for a in fig.axes].count("MoE layer") == 2  # the heat map's and the layers' bar
    save(fig, tmp_path / "experts.png")


def test_a_dense_run_gets_no_expert_picture(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    rows = [{k: v for k, v in r.items() if k not in ("expert_load", "aux_loss")} for r in moe_rows()]
    run = write_run(tmp_path / "dense", rows)
    assert routing(rows, run / "metrics.jsonl") is None
    assert main(["plot", str(run)]) == 0
    assert sorted(p.name for p in run.glob("*.png")) == ["loss.png", "throughput.png"]
    assert "experts.png" not in capsys.readouterr().out


MALFORMED = {
    "ragged": ([[1, 2, 3, 4], [1, 2, 3]], "layers of 4, 3 experts"),
    "not a list": (128, "got int"),
    "flat": ([32, 32, 32, 32], "got list"),
    "not counts": ([["a", 2], [3, 4]], "not all non-negative numbers"),
    "negative": ([[-1, 2], [3, 4]], "not all non-negative numbers"),
    "other run's shape": ([[64, 64]], "is 1 layers x 2 experts, step 1's 2 x 4"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_a_malformed_expert_load_is_one_line_naming_the_step(tmp_path, capsys, case: str) -> None:
    load, says = MALFORMED[case]
    rows = moe_rows(3)
    rows[1]["expert_load"] = load
    run = write_run(tmp_path / "bad", rows)
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step 2" in err and "expert_load" in err and says in err, err
    assert str(run / "metrics.jsonl") in err
    assert not list(run.glob("*.png"))  # checked before any picture is written


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

    from tests.harness import ROOT

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("matplotlib") for d in deps)


def test_every_figure_of_a_run_is_titled_with_its_run_and_steps(tmp_path, monkeypatch) -> None:
    """The figures `plot` writes, caught before they are saved: each one's title names the run (its
    config.yaml's run id, else the directory) and the steps it draws; a run without eval_accuracy (no
    arithmetic evaluation) gets no accuracy axis."""
    pytest.importorskip("matplotlib")
    import megatrain.launch.plot.plots as plots

    rows = moe_rows(5)
    rows[2]["eval_loss"] = 3.0
    run = write_run(tmp_path / "moe", rows)
    (run / "config.yaml").write_text("train:\n  run_id: abc123\n")
    titles: dict[str, list[str]] = {}

    def keep(fig, path: Path) -> None:
        titles[path.name] = [a.get_title() for a in fig.axes if a.get_title()] + [fig.get_suptitle()]
        if path.name == "loss.png":
            assert len(fig.axes) == 1  # no accuracy axis: no row carries eval_accuracy
        plots.pyplot().close(fig)

    monkeypatch.setattr(plots, "save", keep)
    assert plots.main([str(run)]) == 0
    assert titles["loss.png"][0] == titles["throughput.png"][0] == "run abc123, steps 1-5"
    assert titles["experts.png"][-1].startswith("run abc123, steps 1-5: routing")
    (run / "config.yaml").unlink()
    titles.clear()
    assert plots.main([str(run)]) == 0
    assert titles["loss.png"][0] == "run moe, steps 1-5"  # the directory's name stands in
