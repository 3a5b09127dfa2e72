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
