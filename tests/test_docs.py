"""The README's reference tables are the code's: generated from one source, checked here."""

from __future__ import annotations

import json
import re

from megatrain.launch.config import Config, load_config
from megatrain.launch.driver import Trainer
from megatrain.launch.metrics import METRICS, metrics_table

from megatrain.configbase import reference_table
from tests.conftest import ROOT
from tests.helpers import TINY

README = (ROOT / "README.md").read_text()


def block(name: str) -> str:
    m = re.search(rf"<!-- {name}[^\n]*-->\n(.*?)<!-- /{name} -->", README, re.S)
    assert m, f"README has no {name} block"
    return m.group(1)


def test_readme_config_reference_is_generated_from_the_code() -> None:
    assert block("config-reference") == reference_table(Config), (
        "README's config reference is stale: paste the output of `megatrain-launch --config-reference`")


def test_readme_metrics_table_is_generated_from_the_code() -> None:
    assert block("metrics-table") == metrics_table(), "README's metrics table is stale (launch/metrics.py)"


def test_every_field_a_run_writes_is_documented(tmp_path, rid: str) -> None:
    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    cfg = load_config(None, [f"model.hf={hf}", "data.seq_len=32", "data.batch_size=2", "train.steps=2",
                             "train.eval_every=1", "data.ops=+", f"train.run_id={rid}", "train.profile.step=2",
                             f"train.output_dir={tmp_path / 'out'}", "launch.runner=inprocess"])
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    written = set().union(*rows)
    assert written - set(METRICS) == set(), "fields missing from launch/metrics.py"
    assert {"eval_loss", "eval_accuracy", "loop_blocking_calls"} <= written  # the optional groups were exercised
