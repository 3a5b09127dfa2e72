"""Imports go one way: launch -> actors -> ipc -> core (megatrain/), and no module imports one that imports
it back. Read from the source, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.harness import ROOT

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
    bad.write_text("def f():\n    from megatrain.launch.run.driver import Trainer\n")
    assert [(line, layer_of(m)) for line, m in imports(bad)] == [(2, "launch")]


FOLDERS = {"megatrain": "megatrain", **{folder: package for package, folder in PACKAGE_OF.items()}}


def project_modules(root: Path, folders: dict[str, str]) -> dict[str, Path]:
    """Every module by its import name: folder -> the package it is installed as (pyproject.toml)."""
    out = {}
    for folder, package in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
    return out


def named_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name`'s source names in an import anywhere (top level, in a function, under `if
    TYPE_CHECKING:`): `import a.b` names a.b; `from a import b` names a, and a.b too where that is a module.
    The packages a dotted name passes through are imported on the way but not named, so a package's
    __init__ importing its submodules is no cycle by itself, while a submodule that names its package
    (`from pkg import x`) whose __init__ imports it back is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return (out & modules.keys()) - {name}


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Each group of modules that import one another round a cycle (a strongly connected component of the
    import graph, Tarjan's algorithm), as one cycle through them: [a, b, ..., a]."""
    graph = {m: sorted(named_imports(m, p, modules)) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [cycle_through(group, graph) for group in groups]


def cycle_through(group: list[str], graph: dict[str, list[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group (breadth first)."""
    start, members = group[0], set(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{group} is no cycle")


def test_no_import_cycles() -> None:
    """No module imports one that imports it back, directly or round several, lazy and type-checking imports
    included: each fact has one home that the others import."""
    modules = project_modules(ROOT, FOLDERS)
    assert len(modules) > 100, "the module scan found almost nothing: is pyproject.toml's mapping still FOLDERS?"
    found = [" -> ".join(cycle) for cycle in import_cycles(modules)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_cycle_checker_sees_every_kind_of_cycle(tmp_path: Path) -> None:
    """A cycle through a lazy import, one through `if TYPE_CHECKING:`, one of a submodule and its package's
    __init__, one round three modules; a package importing its own submodules is none."""
    files = {
        "core/__init__.py": "from megatrain import pkg\n",
        "core/a.py": "def f():\n    from megatrain.b import g\n",
        "core/b.py": "from megatrain.a import f\n",
        "core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatrain.d import D\n",
        "core/d.py": "import megatrain.c\n",
        "core/pkg/__init__.py": "from megatrain.pkg.sub import x\nfrom megatrain.pkg import leaf\n",
        "core/pkg/sub.py": "from megatrain.pkg import leaf\n",
        "core/pkg/leaf.py": "from .sub import x\n",
        "core/pkg/ok.py": "",
        "core/r1.py": "from megatrain import r2\n",
        "core/r2.py": "from megatrain.r3 import z\n",
        "core/r3.py": "from megatrain.r1 import y\n",
        "core/solo/__init__.py": "from megatrain.solo.one import x\nfrom megatrain.solo import two\n",
        "core/solo/one.py": "from megatrain.solo.two import y\n",
        "core/solo/two.py": "import os\n",
    }
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    cycles = import_cycles(project_modules(tmp_path, {"core": "megatrain"}))
    assert sorted(cycles) == [
        ["megatrain.a", "megatrain.b", "megatrain.a"],
        ["megatrain.c", "megatrain.d", "megatrain.c"],
        ["megatrain.pkg", "megatrain.pkg.sub", "megatrain.pkg"],
        ["megatrain.r1", "megatrain.r2", "megatrain.r3", "megatrain.r1"],
    ]


def test_the_store_workers_start_without_transformers() -> None:
    """The packers, accumulators, checkpoint writer and Adam updater read only the model's layout: importing
    their classes and unpickling the model spec they are sent leaves transformers unimported (it stays a
    second of CPU each beside the executor's imports), and the config comes back whole on first read."""
    import pickle
    import subprocess
    import sys

    from megatrain.model.spec import ModelConfig, build_spec

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


# ---- the library in rooms --------------------------------------------------------------------------------------

ROOM_SIZE = 8  # the modules a folder may hold (__init__.py not counted): one job per folder
LIBRARY = ("megatrain", "actors", "ipc", "launch")  # launch/ keeps no module at its top either


def crowded_rooms(root: Path, loose_allowed: bool = True) -> list[str]:
    """What breaks a library folder's layout: a folder, at any depth (the root included), of more than ROOM_SIZE
    modules; and for launch/ a module at its top (every module lives in the folder of its job)."""
    wrong = []
    if not loose_allowed:
        wrong = [
            f"{p.name} is at the top of {root.name}/" for p in sorted(root.glob("*.py")) if p.name != "__init__.py"
        ]
    for room in [root, *sorted(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        modules = sorted(p.name for p in room.glob("*.py") if p.name != "__init__.py")
        if len(modules) > ROOM_SIZE:
            wrong.append(f"{room.relative_to(root.parent)}/ holds {len(modules)} modules: {', '.join(modules)}")
    return wrong


def test_every_library_folder_holds_at_most_8_modules() -> None:
    assert (ROOT / "launch" / "cli" / "main.py").is_file(), "the scan is not looking at the library"
    wrong = [w for folder in LIBRARY for w in crowded_rooms(ROOT / folder, loose_allowed=folder != "launch")]
    assert not wrong, f"library modules live in folders of at most {ROOM_SIZE}:\n" + "\n".join(wrong)


def test_the_room_check_sees_a_module_at_the_top_and_a_crowded_folder(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    files = ["__init__.py", "loose.py", "full/__init__.py", *(f"full/m{i}.py" for i in range(ROOM_SIZE))]
    files += [f"full/deep/m{i}.py" for i in range(ROOM_SIZE + 1)]
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    assert [w.split(" ")[0] for w in crowded_rooms(root, loose_allowed=False)] == ["loose.py", "lib/full/deep/"]
    assert [w.split(" ")[0] for w in crowded_rooms(root)] == ["lib/full/deep/"]
    for i in range(ROOM_SIZE):  # the root itself is a room: 9 modules at its top
        (root / f"top{i}.py").write_text("")
    assert [w.split(" ")[0] for w in crowded_rooms(root)] == ["lib/", "lib/full/deep/"]


def test_the_launchers_entry_points_reach_main() -> None:
    """The console script pyproject.toml names, and `python -m megatrain.launch.cli` (run-default.sh's)."""
    import importlib
    import re
    import subprocess
    import sys

    from megatrain.launch.cli.main import main

    (script,) = re.findall(r'^megatrain-launch = "([\w.]+:\w+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    module, _, attr = script.partition(":")
    assert getattr(importlib.import_module(module), attr) is main
    done = subprocess.run(
        [sys.executable, "-m", "megatrain.launch.cli", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: megatrain-launch"), done.stderr
