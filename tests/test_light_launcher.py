"""The launcher's quick commands import no torch, numba or transformers modeling code: `--help` (the
program's and each subcommand's) and `status` answer in a fraction of a second, where those imports take
seconds. Each runs in a fresh interpreter, which then prints the heavy modules it holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

HEAVY = (
    "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numba') or m.startswith('transformers.models.'))"
)


def heavy_after(code: str, *args: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after `code` (run with sys.argv[1:] = args)."""
    wrapped = f"import json, sys\n{code}\nprint(json.dumps({HEAVY}))"
    done = subprocess.run([sys.executable, "-c", wrapped, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


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
        "from megatrain.configbase import dump_yaml, reference_table\n"
        "from megatrain.launch.config.tree import Config, load_tree\n"
        "for path in sys.argv[1:]:\n"
        "    cfg, where = load_tree(path, ['optim.lr=3e-4'])\n"
        "    assert dump_yaml(cfg)\n"
        "assert cfg.model.hf['hidden_size'] == 3584\n"
        "assert reference_table(Config)\n"
    )
    assert heavy_after(code, str(ROOT / "examples" / "default.yaml"), str(tmp_path / "qwen7b.yaml")) == []


def test_the_heavy_check_sees_torch() -> None:
    assert "torch" in heavy_after("import torch")


def test_export_names_the_dtypes_the_export_writes() -> None:
    from megatrain.export import DTYPES
    from megatrain.launch.cli.export_cmd import DTYPE_NAMES

    assert sorted(DTYPE_NAMES) == sorted(DTYPES)
