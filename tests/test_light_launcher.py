"""The launcher's quick commands import no torch, numba or transformers modeling code: `--help` (the
program's and each subcommand's) and `status` answer in a fraction of a second, where those imports take
seconds. Each runs in a fresh interpreter, which then prints the heavy modules it holds."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from tests.harness import ROOT, heavy_after

CLI = (
    "from megatrain.launch.cli.main import main\n"
    "try:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
)


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["plan", "--help"], ["export", "--help"], ["plot", "--help"], ["tokenizer", "--help"]],
)
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    assert heavy_after(CLI, *argv) == []


def test_status_imports_nothing_heavy(tmp_path) -> None:
    assert heavy_after(CLI, "status", "--shm-dir", str(tmp_path)) == []


QWEN7B_YAML = """model:
  family: qwen2
  hf: {hidden_size: 3584, intermediate_size: 18944, num_attention_heads: 28, num_key_value_heads: 4,
       vocab_size: 152064, max_position_embeddings: 32768, num_hidden_layers: 28}
data: {seq_len: 4096, batch_size: 16}
"""


def test_the_config_tree_and_its_checks_import_nothing_heavy(tmp_path) -> None:
    """The bundled default and a 7B config, loaded and checked across sections (validate_tree; the model's
    own checks need its HF config class, which imports torch)."""
    (tmp_path / "qwen7b.yaml").write_text(QWEN7B_YAML)
    code = (
        "from megatrain.config.base import dump_yaml, reference_table\n"
        "from megatrain.launch.config.tree import Config, load_tree\n"
        "for path in sys.argv[1:]:\n"
        "    cfg, where = load_tree(path, ['optim.lr=3e-4'])\n"
        "    assert dump_yaml(cfg)\n"
        "assert cfg.model.hf['hidden_size'] == 3584\n"
        "assert reference_table(Config)\n"
    )
    assert heavy_after(code, str(ROOT / "examples" / "default.yaml"), str(tmp_path / "qwen7b.yaml")) == []


MOE_YAML = """model:
  family: qwen3_moe
  hf: {hidden_size: 2048, num_hidden_layers: 48, num_attention_heads: 32, num_key_value_heads: 4, head_dim: 128,
       moe_intermediate_size: 768, num_experts: 128, num_experts_per_tok: 8, vocab_size: 151936, mlp_only_layers: [0]}
data: {seq_len: 4096, batch_size: 16}
"""

# What `megatrain-launch plan` runs of the model for a plan made for another machine (--gpu H100): the model's
# checks, its description and the time section.
PLAN_MODEL = (
    "from megatrain.launch.config import timeplan\n"
    "from megatrain.launch.config.tree import check_model, load_tree\n"
    "from megatrain.config.engine import resolve_engine\n"
    "cfg, where = load_tree(sys.argv[1], ['engine.device=cuda'])\n"
    "arch = check_model(cfg, where)\n"
    "asked = timeplan.Asked('H100', None, True, True)\n"
    "lines = timeplan.plan_lines(cfg, resolve_engine(cfg.engine, True), 1, asked)\n"
    "assert lines[0].startswith('time (an estimate)'), lines\n"
    "print(arch.family, arch.layout.num_params)\n"
)


@pytest.mark.parametrize("kind", ["dense", "moe", "pretrained"])
def test_the_plans_model_checks_and_time_import_nothing_heavy(tmp_path, kind: str) -> None:
    """A dense 7B, an MoE and a model.pretrained directory holding config.json alone (planned before the
    weights are downloaded) are checked, described and timed without torch, numba or modeling code."""
    config = tmp_path / "run.yaml"
    if kind == "pretrained":
        hf = yaml.safe_load(MOE_YAML)["model"]["hf"]
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **hf}))
        config.write_text(f"model: {{pretrained: {tmp_path / 'model'}}}\ndata: {{seq_len: 4096, batch_size: 16}}\n")
    else:
        config.write_text(QWEN7B_YAML if kind == "dense" else MOE_YAML)
    assert heavy_after(PLAN_MODEL, str(config)) == []


def plan_cli(code: int) -> str:
    """`megatrain-launch plan ...` in a fresh interpreter, which must end with exit `code`."""
    return (
        "from megatrain.launch.cli.main import main\n"
        "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as exc:\n    rc = exc.code\n"
        f"assert rc == {code}, rc\n"
    )


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_whole_plan_command_imports_nothing_heavy(tmp_path, kind: str) -> None:
    """The whole plan for a described machine (memory, roles, disk, time), as a user runs it: the 7B fits an
    H100 of a 125 GiB host (exit 0); the 30B MoE does not fit that host (exit 1). Neither loads torch."""
    config = tmp_path / "run.yaml"
    config.write_text((QWEN7B_YAML if kind == "dense" else MOE_YAML) + "engine: {device: cuda}\n")
    machine = ["--gpu-gib", "78", "--host-gib", "125", "--gpu", "H100"]
    assert heavy_after(plan_cli(0 if kind == "dense" else 1), "plan", str(config), *machine) == []


def test_a_plan_for_a_gpu_on_a_machine_without_one_imports_nothing_heavy(tmp_path) -> None:
    """Without a GPU in sight (CUDA_VISIBLE_DEVICES hides every device), a cuda plan with no --gpu-gib is refused
    as a usage error (exit 2) without torch being imported to find that out."""
    config = tmp_path / "run.yaml"
    config.write_text(QWEN7B_YAML + "engine: {device: cuda}\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    assert heavy_after(plan_cli(2), "plan", str(config), env=env) == []


def test_the_plans_model_check_still_refuses(tmp_path) -> None:
    """The torch-free checks are the checks: a mistyped field and a dropout are refused, as validate_model does."""
    from megatrain.errors import ConfigError
    from megatrain.launch.config.tree import check_model, load_tree

    for hf, words in [
        ("{hiden_size: 64}", "did you mean 'model.hf.hidden_size'"),
        ("{attention_dropout: 0.1}", "dropout"),
    ]:
        (tmp_path / "bad.yaml").write_text(f"model: {{family: llama, hf: {hf}}}\n")
        cfg, where = load_tree(tmp_path / "bad.yaml")
        with pytest.raises(ConfigError, match=re.escape(words)):
            check_model(cfg, where)


def test_the_heavy_check_sees_torch() -> None:
    assert "torch" in heavy_after("import torch")


def test_export_names_the_dtypes_the_export_writes() -> None:
    from megatrain.formats.export import DTYPES
    from megatrain.launch.cli.export_cmd import DTYPE_NAMES

    assert sorted(DTYPE_NAMES) == sorted(DTYPES)
