"""docs/architecture.md reads true: what it names exists, and it names every module.

A module is named by its path from the repository root (``server/resources/gc.py``); a package by its
folder with a trailing slash (``server/routes/``), which names its ``__init__.py``. Paths it
names (``tests/helpers/in_process.py``, ``server/routes/*.py``) must exist or match, and
dotted names in code spans (``cachekeeper.restore.marker``, ``server.catalog``,
``cachekeeper.backends.local.LocalBackend``) must be a module, or a module and a name it
defines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("cachekeeper", "server", "client")  # installed as cachekeeper, cachekeeper.server, ...
# A repository path: a top folder, then path characters; not part of a longer path or a URL.
PATH = re.compile(r"(?<![\w./-])((?:cachekeeper|server|client|tests|bench|scripts|docs)/[\w./*-]*)")
DOTTED = re.compile(r"^(?:cachekeeper|server|client)(?:\.\w+)+$")


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _modules() -> list[str]:
    """Every module of the three packages, as the doc must name it."""
    names = []
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO)
            names.append(f"{rel.parent}/" if rel.name == "__init__.py" else str(rel))
    return names


def _named_paths(text: str) -> list[str]:
    return sorted({m.rstrip(".,:;)") for m in PATH.findall(text)})


def _module_file(parts: list[str]) -> Path | None:
    """The file of the dotted module ``parts`` (``cachekeeper.server`` is ``server/``)."""
    if parts[0] == "cachekeeper" and len(parts) > 1 and parts[1] in ("server", "client"):
        parts = parts[1:]
    base = REPO.joinpath(*parts)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _defines(module: Path, name: str) -> bool:
    tree = ast.parse(module.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        elif isinstance(node, ast.ImportFrom | ast.Import):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
    return False


def _dotted_problem(name: str) -> str | None:
    """None when ``name`` is a module, or a module and a name it defines; else why not."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        if len(rest) == 1 and _defines(module, rest[0]):
            return None
        return f"{name}: {'.'.join(parts[:cut])} defines no {'.'.join(rest)}"
    return f"{name}: no such module"


def test_every_path_it_names_exists() -> None:
    missing = [
        p
        for p in _named_paths(_text())
        if not ((REPO / p).exists() if "*" not in p else any(REPO.glob(p)))
    ]
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_dotted_name_in_a_code_span_exists() -> None:
    spans = {s for s in re.findall(r"`([^`\n]+)`", _text()) if DOTTED.match(s)}
    problems = sorted(filter(None, map(_dotted_problem, spans)))
    assert problems == []


def test_every_package_module_is_named() -> None:
    text = _text()
    unnamed = [m for m in _modules() if m not in text]
    assert unnamed == [], f"docs/architecture.md does not name: {unnamed}"


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ("`server/no_such.py`", "path"),
        ("`cachekeeper.no_such`", "dotted"),
        ("`cachekeeper.restore.marker.no_such_name`", "dotted"),
    ],
)
def test_the_checks_catch_what_they_look_for(doc: str, problem: str) -> None:
    """The checks above fail on a doc that names what is not there."""
    if problem == "path":
        assert _named_paths(doc) == ["server/no_such.py"]
        assert not (REPO / "server/no_such.py").exists()
    else:
        assert _dotted_problem(doc.strip("`")) is not None
    assert _dotted_problem("cachekeeper.restore.marker.is_restored") is None
    assert _dotted_problem("cachekeeper.server.catalog") is None
    assert _dotted_problem("server.catalog.Catalog") is None
