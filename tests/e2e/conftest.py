"""What the e2e tests share beyond tests/conftest.py: the CLI as a node runs it (``ck``),
a /metrics counter (``counter``), a plain shell's thread environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers.metrics import scrape
from tests.helpers.requires import require

CK = str(Path(sys.executable).parent / "cachekeeper")


def ck(*args: str, server: str, token: str | None = "write-token", home: Path, **kw):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CACHEKEEPER_TOKEN", "TORCHINDUCTOR_CACHE_DIR")
    }
    env.update(CACHEKEEPER_SERVER=server, CACHEKEEPER_HOME=str(home))
    if token is not None:
        env["CACHEKEEPER_TOKEN"] = token
    return subprocess.run([CK, *args], capture_output=True, text=True, env=env, timeout=300, **kw)


def counter(url: str, name: str) -> float:
    """A counter of the server's /metrics (read scope: a read token, ignored with auth off)."""
    with httpx.Client(base_url=url) as client:
        return scrape(client, name, token="read-token")


@pytest.fixture
def shell_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a plain shell: no thread-count variables, no faked GPU (torch
    needed). Tests of the CPU thread count compare against what such a shell has."""
    require("torch")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CACHEKEEPER_TEST_FAKE_CUDA"):
        monkeypatch.delenv(name, raising=False)
