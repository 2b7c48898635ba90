"""Package-wide rules: no torch in the server/client/hook, help on every command, public API."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachekeeper.cli import COMMANDS, cli

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "module",
    [
        "cachekeeper.server.app",
        "cachekeeper.client",
        "cachekeeper.cli.transfer",
        "cachekeeper.client.agent",
        "cachekeeper.cli.serve",
    ],
)
def test_server_and_client_never_import_torch(module: str) -> None:
    code = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_prejob_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from cachekeeper.cli import main\n"
        "try:\n    main(['prejob', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'CLEAN')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("CLEAN")


def test_a_checkout_imports_server_and_client_under_cachekeeper_and_no_other_folder() -> None:
    """From the repository root, ``cachekeeper.server`` and ``cachekeeper.client`` are the
    checkout's ``server/`` and ``client/``; its other folders are not subpackages
    (``cachekeeper.tests`` imported while the whole root was on ``cachekeeper.__path__``)."""
    code = (
        "import importlib, json, cachekeeper.server.app, cachekeeper.client.api\n"
        "found = [cachekeeper.server.app.__file__, cachekeeper.client.api.__file__]\n"
        "for name in ('tests', 'tests.helpers', 'bench', 'docs', 'scripts', 'deploy'):\n"
        "    try:\n"
        "        found.append(importlib.import_module('cachekeeper.' + name).__name__)\n"
        "    except ModuleNotFoundError as exc:\n"
        "        found.append(exc.name)\n"
        "print(json.dumps(found))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    server_app, client_api, *others = json.loads(out.stdout)
    assert (server_app, client_api) == (str(REPO / "server/app.py"), str(REPO / "client/api.py"))
    assert (REPO / "tests" / "__init__.py").is_file()  # a package, so it could import
    assert others == ["cachekeeper.tests"] * 2 + [
        f"cachekeeper.{name}" for name in ("bench", "docs", "scripts", "deploy")
    ]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_exists_and_has_help(name: str) -> None:
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "not available in this build" not in " ".join(result.output.split())
    usage_and_help = result.output.split("Options:")[0]
    assert len(usage_and_help.strip().splitlines()) >= 3, f"{name} has no help text"


def test_error_codes_are_unique_and_complete() -> None:
    from cachekeeper import errors

    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        assert errors.error_for_code(cls.code) is cls
        assert 400 <= cls.http_status < 600
    assert errors.error_for_code("no-such-code") is errors.ServerError


# -- imports at module level (STYLE.md): a function-local import of the project says why ----

PROJECT_FOLDERS = ("cachekeeper", "server", "client")


def _statement_lists(tree: ast.AST) -> Iterator[list[ast.stmt]]:
    """Every list of statements inside a function (bodies of the function, its ifs, trys, ...)."""
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            for field in ("body", "orelse", "finalbody", "handlers"):
                value = getattr(node, field, None)
                if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                    yield value


def _is_project_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "cachekeeper"
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "cachekeeper" for a in node.names)
    return False


def unexplained_local_imports(source: str, *, name: str) -> list[str]:
    """``name:line`` of each function-local import of the project with no reason given: a
    comment on its line, or on the first line of its run of imports, or the line above that
    run (``# Hook start-up: ...`` over two imports explains both)."""
    lines = source.splitlines()
    found: list[str] = []
    seen: set[int] = set()
    for body in _statement_lists(ast.parse(source)):
        run: list[ast.stmt] = []
        for stmt in [*body, None]:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                run.append(stmt)
                continue
            if run:
                first = run[0].lineno
                above = lines[first - 2].strip() if first > 1 else ""
                run_says_why = "#" in lines[first - 1] or above.startswith("#")
                for imp in run:
                    own = "#" in lines[imp.lineno - 1]
                    if _is_project_import(imp) and not (own or run_says_why):
                        if imp.lineno not in seen:
                            seen.add(imp.lineno)
                            found.append(f"{name}:{imp.lineno}")
            run = []
    return found


def test_the_import_check_finds_an_unexplained_local_import() -> None:
    """The check below fails where it should: a bare local import of the project, and not
    where a reason is given (on the line, on the run's first line, or above the run)."""
    bare = "def f():\n    x = 1\n    from cachekeeper.wire import to_dict\n    return x\n"
    assert unexplained_local_imports(bare, name="m.py") == ["m.py:3"]
    relative = "def f():\n    if True:\n        from .api import CacheClient\n"
    assert unexplained_local_imports(relative, name="m.py") == ["m.py:3"]
    explained = (
        "def f():\n"
        "    from .api import A  # hook start-up\n"
        "    from .pull import pull\n"
        "    # cycle: b imports this module\n"
        "    from cachekeeper.b import c\n"
        "    from cachekeeper.d import e\n"
        "    import torch\n"  # not the project's: TID253 and the child processes hold that one
    )
    assert unexplained_local_imports(explained, name="m.py") == []


def test_every_function_local_import_of_the_project_says_why() -> None:
    """STYLE.md: imports at module level, so the import graph is what a reader sees; a
    function-local import of the project is an exception with its reason on its line (the
    hook's start-up budget, a cycle, an optional extra). cli/status.py had one without."""
    found = []
    for folder in PROJECT_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            found += unexplained_local_imports(path.read_text(encoding="utf-8"), name=rel)
    assert found == [], f"function-local imports of the project without a reason: {found}"
