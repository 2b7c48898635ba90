"""What scripts/setup installs is required, never a reason to skip.

``pytest.importorskip("torch")`` turned a broken or missing install into skips: the whole
compile suite could vanish from a run that still passed. A test needing something
scripts/setup installs calls ``require`` instead, and fails with the fix in one line.
Skips stay for what a host may lack (a browser, nginx, user namespaces, a second CPU),
and ``-ra`` lists each with its reason.
"""

from __future__ import annotations

import importlib.util

import pytest

__all__ = ["require"]


def require(module: str) -> None:
    """Fail this test (never skip it) when ``module`` cannot be imported here."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        pytest.fail(
            f"{module} is not installed in this environment: ./scripts/setup installs it",
            pytrace=False,
        )
