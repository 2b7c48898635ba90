"""The HTTP client and pre-job hook (installed as ``cachekeeper.client``). Never imports torch.

The public names below load on first use (PEP 562), so ``cachekeeper prejob`` imports only
what its fast path needs. The functions live in their modules, named like them:
``cachekeeper.client.push.push``, ``.pull.pull``, ``.prejob.prejob``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CacheClient",
    "Deadline",
    "Resolution",
    "NearMiss",
    "PushReport",
    "PullReport",
    "PrejobReport",
]

_HOME = {
    "CacheClient": "api",
    "Deadline": "calls",
    "Resolution": "api",
    "NearMiss": "api",
    "PushReport": "push",
    "PullReport": "pull",
    "PrejobReport": "prejob",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'cachekeeper.client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
