"""No class in ``server/`` has more than 20 public methods (issue 33, point 3).

``server/storage.py``'s ``Storage`` once held 37 public methods over snapshots, blobs,
workloads, agents, reports, the fleet and GC, and the catalog's ``Catalog`` and
``Transaction`` got theirs from mixins: a new route touched a dozen files. Each resource
now has its own service and its own queries (``server/resources/``); this test keeps it
so, by reading the source (no import), so that a class that grows past the bound is
refused where it grows.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_PUBLIC_METHODS = 20


def _public_methods(node: ast.ClassDef) -> list[str]:
    return [
        item.name
        for item in node.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
        and not item.name.startswith("_")
    ]


def _classes(root: Path) -> dict[str, list[str]]:
    """{``path:Class``: its public methods} of every class under ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[f"{path.relative_to(REPO)}:{node.name}"] = _public_methods(node)
    return found


def test_no_class_in_the_server_has_more_than_20_public_methods() -> None:
    classes = _classes(REPO / "server")
    assert "server/resources/snapshots.py:Snapshots" in classes  # the walk sees the services
    over = {name: len(methods) for name, methods in classes.items() if len(methods) > 20}
    assert over == {}, f"classes over {MAX_PUBLIC_METHODS} public methods: {over}"


def test_the_count_is_of_public_methods_and_refuses_a_storage_class(tmp_path: Path) -> None:
    """The rule holds against the class it was written for: one of 37 public methods."""
    body = "".join(f"    def method_{i}(self) -> None: ...\n" for i in range(37))
    private = "".join(f"    def _helper_{i}(self) -> None: ...\n" for i in range(30))
    (tmp_path / "storage.py").write_text(f"class Storage:\n{body}{private}", encoding="utf-8")
    tree = ast.parse((tmp_path / "storage.py").read_text(encoding="utf-8"))
    (storage,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert len(_public_methods(storage)) == 37 > MAX_PUBLIC_METHODS
