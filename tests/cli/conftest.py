"""What the CLI tests share: running a command through click (``run``) or as its own
process (``ck``), and a tiny cache dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachekeeper.cli import cli

CK = str(Path(sys.executable).parent / "cachekeeper")


def ck(
    *args: str, cwd: Path, home: Path | None = None, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_"))
    }
    env["CACHEKEEPER_HOME"] = str(home or cwd / "home")
    env.update(env_extra)
    return subprocess.run(
        [CK, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    (root / "fxgraph" / "ab").mkdir(parents=True)
    (root / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    (root / "ab.py").write_bytes(b"print(1)")
    return root
