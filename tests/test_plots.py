"""`megatrain-launch plot RUN_DIR`: loss, throughput and the recorded step's timeline, from a real run."""

from __future__ import annotations

import json
import sys

import pytest
from megatrain.launch.cli import main
from megatrain.launch.config import load_config
from megatrain.launch.driver import Trainer
from megatrain.launch.plots import run_flops

from tests.helpers import TINY

PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_the_runs_pictures(tmp_path, rid: str, capsys) -> None:
    pytest.importorskip("matplotlib")
    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    out = tmp_path / "run"
    cfg = load_config(None, [f"model.hf={hf}", "data.seq_len=32", "data.batch_size=2", "train.steps=4",
                             "train.eval_every=2", "train.timeline_step=3", f"train.run_id={rid}",
                             f"train.output_dir={out}", "launch.runner=inprocess"])
    summary = Trainer(cfg).run()
    assert main(["plot", str(out)]) == 0
    for name in ("loss.png", "throughput.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name
    assert "timeline.png" in capsys.readouterr().out
    tokens = 2 * 32  # TFLOPS from the run's config.yaml: (6ND + 12LHSD) per step
    assert run_flops(out) == 6 * summary["num_params"] * tokens + 12 * 2 * TINY["hidden_size"] * 32 * tokens
    (out / "timeline.json").unlink()
    elsewhere = tmp_path / "pictures"
    assert main(["plot", str(out), "--out", str(elsewhere)]) == 0
    assert sorted(p.name for p in elsewhere.iterdir()) == ["loss.png", "throughput.png"]


def test_plot_of_a_directory_that_is_no_run_is_a_usage_error(tmp_path, capsys) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no metrics.jsonl" in err and str(tmp_path) in err


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "tokens_per_s": 1.0,
                                                        "step_time_s": 1.0}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(tmp_path)]) == 2
    assert "pip install 'megatrain[plot]'" in capsys.readouterr().err
