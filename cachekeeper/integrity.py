"""The one integrity check: what a digest looks like.

Every blob is named by the sha256 of its uncompressed bytes, written as 64 lowercase hex
characters (``DIGEST_PATTERN``; snapshot ids are digests too). The wire shapes, the
routes' path parameters, the manifest and every blob backend use this one pattern. A name
that is not one is refused with ``InvalidDigest`` (``require_digest``) before anything is
looked up or written: a malformed name is a bad request, never ``DigestMismatch``, which
means bytes that hash to another digest than the one they came with.

Stdlib only and light: the hook's modules import it (through ``cachekeeper.manifest``).
"""

from __future__ import annotations

import re

from cachekeeper.errors import InvalidDigest

__all__ = ["DIGEST_PATTERN", "is_digest", "require_digest"]

DIGEST_PATTERN = r"^[0-9a-f]{64}$"  # lowercase sha256 hex: the wire's and the routes' too
_DIGEST_RE = re.compile(DIGEST_PATTERN)


def is_digest(value: object) -> bool:
    """True for a lowercase sha256 hex string."""
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None


def require_digest(value: object, *, what: str = "blob digest") -> str:
    """``value`` when it is a digest; else InvalidDigest naming it as ``what``."""
    if not isinstance(value, str) or not is_digest(value):
        raise InvalidDigest(f"{value!r} is not a {what} (64 lowercase hex characters of a sha256)")
    return value
