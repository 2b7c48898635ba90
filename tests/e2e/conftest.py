"""What the e2e tests share beyond tests/conftest.py."""

from __future__ import annotations

import pytest

from tests.helpers.requires import require


@pytest.fixture
def shell_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a plain shell: no thread-count variables, no faked GPU (torch
    needed). Tests of the CPU thread count compare against what such a shell has."""
    require("torch")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CACHEKEEPER_TEST_FAKE_CUDA"):
        monkeypatch.delenv(name, raising=False)
