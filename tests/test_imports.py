"""Imports go one way: launch -> actors -> ipc -> core (megatrain/). Read from the source, so a lazy
import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

LAYERS = {"launch": 3, "actors": 2, "ipc": 1, "megatrain": 0}  # folder -> rank; a module imports rank <= its own
PACKAGE_OF = {"megatrain.launch": "launch", "megatrain.actors": "actors", "megatrain.ipc": "ipc"}


def layer_of(module: str) -> str | None:
    if not module.startswith("megatrain"):
        return None
    for prefix, folder in PACKAGE_OF.items():
        if module == prefix or module.startswith(prefix + "."):
            return folder
    return "megatrain"


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def test_imports_go_one_way() -> None:
    wrong = []
    for folder, rank in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, module in imports(path):
                target = layer_of(module)
                if target is not None and LAYERS[target] > rank:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({folder} -> {target})")
    assert not wrong, "imports against launch -> actors -> ipc -> core:\n" + "\n".join(wrong)


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from megatrain.launch.driver import Trainer\n")
    assert [(line, layer_of(m)) for line, m in imports(bad)] == [(2, "launch")]


def test_the_store_workers_start_without_transformers() -> None:
    """The packers, accumulators, checkpoint writer and Adam updater read only the model's layout: importing
    their classes and unpickling the model spec they are sent leaves transformers unimported (it stays a
    second of CPU each beside the executor's imports), and the config comes back whole on first read."""
    import pickle
    import subprocess
    import sys

    from megatrain.model import ModelConfig, build_spec

    spec = build_spec(ModelConfig(family="qwen2", hf={"hidden_size": 32, "intermediate_size": 64, "vocab_size": 64}))
    code = (
        "import pickle, sys\n"
        "import megatrain.actors.adam_updater, megatrain.actors.packer\n"
        "import megatrain.actors.grad_accumulator, megatrain.actors.checkpoint_writer\n"
        "spec = pickle.loads(sys.stdin.buffer.read())\n"
        "print(spec.layout.num_params, 'transformers' in sys.modules)\n"
        "print(spec.hf_config.hidden_size, type(spec.hf_config).__name__, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(spec), capture_output=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split("\n")[:2] == [f"{spec.layout.num_params} False", "32 Qwen2Config True"]
    again = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(spec))))  # passed on still packed
    assert again.hf_config.to_dict() == spec.hf_config.to_dict() and again.layout == spec.layout
    again.hf_config.rms_norm_eps = 0.125  # once unpickled, the object itself travels on, changes and all
    assert pickle.loads(pickle.dumps(again)).hf_config.rms_norm_eps == 0.125 != spec.hf_config.rms_norm_eps
