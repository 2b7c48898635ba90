"""The per-key tier over HTTP (``/v1/tier/...``, docs/api.md): what cachekeeper's own
remote-cache backend (``cachekeeper/_tier_hook/``) asks before it sends a value.

A GET of a value has no JSON shape (its answer is the value's bytes, a 307 to the object
store, or a 404); a put is a small JSON question first, so the value's bytes travel once,
to the right place, or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from ._core import Check, Count, Digest

# torch's keys are ``pt2:<cache id>::<key>:c1``, about 100 characters.
MAX_TIER_KEY_LENGTH = 1024
# The environment a value was written from: the first 12 hex digits of the writer's
# fingerprint digest (``cachekeeper.remote_tier.environment_of``), or "" when unknown.
ENVIRONMENT_PATTERN = r"^([0-9a-f]{12})?$"

TierKey = Annotated[str, Check(max_length=MAX_TIER_KEY_LENGTH)]
Environment = Annotated[str, Check(pattern=ENVIRONMENT_PATTERN)]
TierAction = Literal["stored", "send", "upload", "dropped"]


@dataclass(frozen=True, kw_only=True)
class TierPutRequest:
    """``POST /v1/tier/puts``: a node would put ``size_bytes`` bytes of sha256 ``digest``
    under ``key``, written from ``environment``."""

    key: TierKey
    digest: Digest
    size_bytes: Count
    environment: Environment = ""


@dataclass(frozen=True, kw_only=True)
class TierPutAnswer:
    """What to do with the value: ``stored`` (the server had those bytes: the key now
    points at them, nothing to send), ``send`` (``PUT /v1/tier/values/{key}`` with the
    bytes), ``upload`` (PUT them to ``url`` with ``headers``, then ``POST
    /v1/tier/commits``), ``dropped`` (not stored; ``reason`` says why)."""

    action: TierAction
    url: str | None = None
    headers: dict[str, str] | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class TierCommitRequest:
    """``POST /v1/tier/commits``: the value uploaded to the object store is complete; the
    server reads it back, checks its size and sha256, then points ``key`` at it."""

    key: TierKey
    digest: Digest
    size_bytes: Count
    environment: Environment = ""
