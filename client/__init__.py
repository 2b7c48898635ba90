"""The HTTP client and pre-job hook (installed as ``cachekeeper.client``). Never imports torch.

The public names below load on first use (PEP 562), so ``cachekeeper prejob`` imports only
what its fast path needs. The functions live in their modules, named like them:
``cachekeeper.client.push.push``, ``.pull.pull``, ``.prejob.prejob``.
"""

from __future__ import annotations

from cachekeeper._lazy import lazy_getattr

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


__getattr__ = lazy_getattr(__name__, _HOME)


def __dir__() -> list[str]:
    return sorted(__all__)
