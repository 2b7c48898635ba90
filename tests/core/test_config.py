"""Every CACHEKEEPER_* variable is read in cachekeeper/config.py, from the mapping passed in."""

from __future__ import annotations

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


def test_no_other_module_reads_a_cachekeeper_variable() -> None:
    """Only config.py names the variables' values; others may name them in help and errors."""
    out = subprocess.run(
        ["git", "grep", "-nE", r"(\.get\(|environ\[|getenv\()\s*\"CACHEKEEPER_", "--", "cachekeeper",
         "client", "server"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert out.stdout == "", out.stdout


def test_importing_config_is_cheap_for_the_hook() -> None:
    code = "import cachekeeper.config, sys; print(sorted(sys.modules).count('importlib.metadata'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
