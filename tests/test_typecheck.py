"""The type check sees one program: a wrong call across the seam fails it, naming its line.

``scripts/typecheck.py`` (what ``scripts/test`` and ``scripts/test-fast`` run) checks
``server/app.py`` as ``cachekeeper.server.app``, so an import of that name is that file.
``mypy cachekeeper server client``, which the scripts ran before, checked it as
``server.app``: ``cachekeeper.server.*`` and ``cachekeeper.client.*`` imports were ``Any``, and
``CacheClient(base_url=1, no_such_keyword=2)`` in a server module passed.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "typecheck.py"

# (file, the call appended to it, what mypy must say of that line)
WRONG_CALLS = [
    (
        "server/resources/gc.py",
        "from cachekeeper.client.api import CacheClient\n\n"
        "    CacheClient(base_url=1, no_such_keyword=2)",
        ['Unexpected keyword argument "no_such_keyword" for "CacheClient"', '"base_url"'],
    ),
    (
        "cachekeeper/cli/status.py",
        "from cachekeeper.server.app import create_app\n\n    create_app(no_such_setting=1)",
        ['Unexpected keyword argument "no_such_setting" for "create_app"'],
    ),
]


def _typecheck_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("typecheck", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_tree(dest: Path) -> Path:
    """What the check reads: the three packages, pyproject.toml and the script itself."""
    skip = shutil.ignore_patterns("__pycache__")
    for folder in ("cachekeeper", "server", "client"):
        shutil.copytree(REPO / folder, dest / folder, ignore=skip)
    (dest / "scripts").mkdir()
    shutil.copy2(SCRIPT, dest / "scripts" / "typecheck.py")
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    """The project's check, run from elsewhere (it works from its own root)."""
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "typecheck.py")],
        capture_output=True,
        text=True,
        cwd=root.parent,
        timeout=280,
    )


def test_the_test_scripts_run_this_check() -> None:
    """The check this file proves is the one the developer loop and CI run."""
    for script in ("test", "test-fast"):
        lines = (REPO / "scripts" / script).read_text().splitlines()
        assert any(line.startswith(".venv/bin/python scripts/typecheck.py") for line in lines)
        assert not any(line.startswith(".venv/bin/mypy") for line in lines), script


def test_each_file_gets_the_module_name_the_wheel_gives_it() -> None:
    typecheck = _typecheck_module()
    dirs = typecheck.package_dirs(REPO / "pyproject.toml")
    assert dirs == {
        "cachekeeper": "cachekeeper",
        "server": "cachekeeper.server",
        "client": "cachekeeper.client",
    }
    names = {
        "server/app.py": "cachekeeper.server.app",
        "server/__init__.py": "cachekeeper.server",
        "server/routes/admin.py": "cachekeeper.server.routes.admin",
        "client/api.py": "cachekeeper.client.api",
        "cachekeeper/__init__.py": "cachekeeper",
        "cachekeeper/restore/core.py": "cachekeeper.restore.core",
        "tests/test_typecheck.py": None,  # not a package folder: mypy's own name stays
        "serverless.py": None,
    }
    assert {path: typecheck.module_name(path, dirs) for path in names} == names


@pytest.mark.slow  # mypy over the whole tree from an empty cache: ~55 s on the loaded dev VM
def test_a_wrong_call_across_the_seam_fails_the_check_naming_its_line(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path / "tree")
    clean = _check(root)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout.startswith("Success: no issues found"), clean.stdout

    lines = {}
    for path, call, _ in WRONG_CALLS:
        source = root / path
        text = source.read_text()
        text += f"\n\ndef _wrong_call_across_the_seam() -> None:\n    {call}\n"
        source.write_text(text)
        lines[path] = len(text.splitlines())  # the call is the last line

    wrong = _check(root)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    errors = [line for line in wrong.stdout.splitlines() if ": error: " in line]
    for path, _, expected in WRONG_CALLS:
        at = f"{path}:{lines[path]}: error: "  # the real path, relative to the tree's root
        said = " ".join(e for e in errors if e.startswith(at))
        assert all(text in said for text in expected), (path, wrong.stdout)
    assert len(errors) == sum(len(expected) for *_, expected in WRONG_CALLS), wrong.stdout
