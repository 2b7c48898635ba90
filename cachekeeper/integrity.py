"""The one integrity check: what a digest looks like.

Every blob is named by the sha256 of its uncompressed bytes, written as 64 lowercase hex
characters (``DIGEST_PATTERN``; snapshot ids are digests too). The wire shapes, the
routes' path parameters, the manifest and every blob backend use this one pattern.

Stdlib only and light: the hook's modules import it (through ``cachekeeper.manifest``).
"""

from __future__ import annotations

import re

__all__ = ["DIGEST_PATTERN", "is_digest"]

DIGEST_PATTERN = r"^[0-9a-f]{64}$"  # lowercase sha256 hex: the wire's and the routes' too
_DIGEST_RE = re.compile(DIGEST_PATTERN)


def is_digest(value: object) -> bool:
    """True for a lowercase sha256 hex string."""
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None
