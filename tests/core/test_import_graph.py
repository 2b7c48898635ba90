"""The core imports itself one way: no circle among the modules of ``cachekeeper/``.

Issue 33 found one circle (cpu, devices, fingerprint and remote_tier imported each other,
through function-local imports marked "cycle" and ``TYPE_CHECKING`` imports), and the
builder two more (kinds.base and kinds.command named each other for ``Command``; the command
kind's run machinery reached the allowlist, the workload and the kinds back). A circle
makes a module unreadable alone and its import order fragile. Every import statement
counts here: at module level, inside functions, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "cachekeeper"


def module_sources(root: Path) -> dict[str, str]:
    """{dotted module name: source} of every ``.py`` under ``root`` (a package folder)."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path.read_text(encoding="utf-8")
    return found


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """{module: the modules of ``sources`` it imports, by any import statement anywhere}.
    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``."""

    def known(name: str) -> str | None:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        is_package = any(other.startswith(module + ".") for other in sources)
        package = module if is_package else module.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: max(package.count(".") + 2 - node.level, 0)]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges.update(t for t in map(known, names) if t is not None and t != module)
        graph[module] = edges
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_check_finds_a_circle_through_a_local_and_a_type_checking_import() -> None:
    """The check below fails where it should: the shape of the circle issue 33 found."""
    sources = {
        "pkg": "",
        "pkg.fingerprint": "from pkg import cpu\nfrom pkg.devices import advice\n",
        "pkg.cpu": "if TYPE_CHECKING:\n    from pkg.fingerprint import CpuState\n",
        "pkg.devices": "def visible():\n    from pkg.fingerprint import collect  # cycle\n",
        "pkg.wire": "from . import errors\n",
        "pkg.errors": "",
    }
    assert cycles(import_graph(sources)) == [["pkg.cpu", "pkg.devices", "pkg.fingerprint"]]
    sources["pkg.cpu"] = sources["pkg.devices"] = ""
    assert cycles(import_graph(sources)) == []
    assert import_graph(sources)["pkg.wire"] == {"pkg.errors"}


def test_the_core_imports_itself_one_way() -> None:
    """No circle in the core, the builder included: ``Command`` (a ``[[command]]``
    table's data) is ``builder.kinds.command_spec`` and where a program is
    ``builder.programs``, each importing none of the modules that use it."""
    graph = import_graph(module_sources(CORE))
    assert graph["cachekeeper.environment.fingerprint"] >= {"cachekeeper.environment.cpu"}
    assert "cachekeeper.builder.commands" in graph["cachekeeper.builder.kinds.command"]
    assert cycles(graph) == []
