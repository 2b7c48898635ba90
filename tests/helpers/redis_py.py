"""The redis-py versions scripts/setup installs side by side (``.venv/redis-py/<version>``):
torch's client of the per-key tier, picked for a child process by its PYTHONPATH."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REDIS_PY", "redis_py_env", "redis_py_versions"]

REDIS_PY = Path(__file__).resolve().parents[2] / ".venv" / "redis-py"


def redis_py_versions() -> list[str]:
    """Installed versions, oldest first (``["7.4.1", "8.1.0"]`` after scripts/setup)."""
    if not REDIS_PY.is_dir():
        return []
    found = [p.name for p in REDIS_PY.iterdir() if (p / "redis" / "__init__.py").is_file()]
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def redis_py_env(version: str) -> dict[str, str]:
    """The variables that make a child process import redis-py ``version``."""
    path = str(REDIS_PY / version)
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": path if not old else f"{path}{os.pathsep}{old}"}
