"""Every CACHEKEEPER_* variable is read in cachekeeper/config.py, from the mapping passed in."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from cachekeeper import config

REPO = Path(__file__).resolve().parents[2]


def test_home_and_the_dirs_under_it() -> None:
    default = Path.home() / ".cache" / "cachekeeper"
    assert config.home({}) == default
    assert config.home({"CACHEKEEPER_HOME": ""}) == default  # empty is unset
    env = {"CACHEKEEPER_HOME": "/h"}
    assert config.home(env) == Path("/h")
    assert config.agent_work_dir(env) == Path("/h/agent")
    assert config.server_data_dir(env) == Path("/h/server")
    assert config.node_cache_dir("ab" * 32, env) == Path("/h/inductor") / ("ab" * 8)


def test_lists_flags_and_overrides() -> None:
    env = {"CACHEKEEPER_TRUSTED_KEYS": f"a.pub{os.pathsep}{os.pathsep} b.pub"}
    assert config.trusted_key_paths(env) == ["a.pub", " b.pub"]
    assert config.trusted_key_paths({}) == []
    assert config.debug({"CACHEKEEPER_DEBUG": "1"}) and not config.debug({})
    assert config.fingerprint_overrides({"CACHEKEEPER_FINGERPRINT_OVERRIDES": '{"a": 1}'}) == {
        "a": 1
    }
    assert config.fingerprint_overrides({}) == {}


def _reads(tree: ast.AST) -> list[int]:
    """Lines that look a CACHEKEEPER_ name up: ``x["CACHEKEEPER_.."]``, ``x.get("CACHEKEEPER_..")``."""

    def named(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and str(node.value).startswith("CACHEKEEPER_")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and named(node.slice):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "getenv", "pop", "setdefault")
            and node.args
            and named(node.args[0])
        ):
            lines.append(node.lineno)
    return lines


def test_no_other_module_reads_a_cachekeeper_variable() -> None:
    """Only config.py looks the variables up; others may name them in help and errors."""
    found = [
        f"{path.relative_to(REPO)}:{line}"
        for folder in ("cachekeeper", "client", "server")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path.name != "config.py"
        for line in _reads(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert found == []
    assert _reads(ast.parse('import os\nos.environ.get("CACHEKEEPER_HOME")')) == [2]


def test_importing_config_is_cheap_for_the_hook() -> None:
    code = "import cachekeeper.config, sys; print(sorted(sys.modules).count('importlib.metadata'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
