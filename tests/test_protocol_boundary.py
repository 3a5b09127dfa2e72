"""The protocol lives in ipc/protocol/: the actors call its functions and never touch a version counter, a
semaphore or a slab themselves (a sequence written out in an actor is how a missing fence or a wrong order
gets in). Library code has no `assert` (`python -O` drops them). Both read from the source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.harness import ROOT

LOW_LEVEL = {
    "versions",
    "saved",
    "sqnorms",
    "sems",
    "version",
    "publish_version",
    "publish_versions",
    "wait_version",
    "publish_saved",
    "wait_saved",
    "grad_slab",
    "weight_slab",
    "_wait_reached",
    "_waiting",
}
STORE_VERBS = {"wait", "post"}  # a semaphore's, when called on a store
SEMAPHORE = re.compile(r"\b(grads_ready|[gw]_(full|free)\d*)\b")
MODULES = {"posix_ipc", "megatrain.ipc.shared.fence"}


def _on_store(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "store") or (
        isinstance(node, ast.Attribute) and node.attr == "store"
    )


def leaks(source: str) -> list[str]:
    """Where `source` touches the protocol's low-level state: 'line: what'."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in LOW_LEVEL:
            out.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in STORE_VERBS and _on_store(node.value):
            out.append(f"{node.lineno}: store.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SEMAPHORE.search(node.value):
            out.append(f"{node.lineno}: semaphore {SEMAPHORE.search(node.value).group(0)!r}")
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES:
            out.append(f"{node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Import):
            out += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in MODULES]
    return out


def test_actors_call_the_protocol_and_touch_nothing_below_it() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{leak}" for p in sorted((ROOT / "actors").glob("*.py")) for leak in leaks(p.read_text())
    ]
    assert not found, "actors touching versions, semaphores or slabs (use ipc/protocol/):\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_leak() -> None:
    source = """
import posix_ipc
from megatrain.ipc.shared.fence import publish
def f(self, item, store):
    have = int(self.store.versions[item.piece])
    self.store.publish_version(item.piece, 3)
    store.wait(f"g_full{item.slab}", "a gradient")
    self.store.post("grads_ready")
    store.sqnorms[0] = 1.0
    self.done.wait(0.1)  # a threading.Event: not the store's
"""
    found = leaks(source)
    assert sorted(found) == sorted(
        [
            "2: imports posix_ipc",
            "3: imports megatrain.ipc.shared.fence",
            "5: .versions",
            "6: .publish_version",
            "7: store.wait",
            "7: semaphore 'g_full'",
            "8: store.post",
            "8: semaphore 'grads_ready'",
            "9: .sqnorms",
        ]
    ), found


def asserts(path: Path) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Assert)]


def test_no_assert_in_library_code() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{line}"
        for folder in ("actors", "ipc", "launch")
        for p in sorted((ROOT / folder).rglob("*.py"))
        for line in asserts(p)
    ]
    assert not found, "assert in library code (raise an exception; python -O drops asserts):\n" + "\n".join(found)


def test_the_assert_scan_sees_one(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f(x):\n    assert x > 0\n")
    assert asserts(bad) == [2]
