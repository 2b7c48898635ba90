"""Names a package loads on first use (PEP 562), so that importing it stays light.

``cachekeeper``, ``cachekeeper.client`` and ``cachekeeper.wire`` each map their public names
to the submodule that defines them and set ``__getattr__ = lazy_getattr(__name__, homes)``:
the pre-job hook then imports only the modules its path uses (see docs/benchmarks.md).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes`` maps each name to its submodule
    (relative to ``package``); a name is imported on first use and kept in the package."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
