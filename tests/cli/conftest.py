"""What the CLI tests share: running a command through click, and a tiny cache dir."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from cachekeeper.cli import cli


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
