"""The one integrity check: what a digest looks like, and bytes checked against one.

Every blob is named by the sha256 of its uncompressed bytes, written as 64 lowercase hex
characters (``DIGEST_PATTERN``; snapshot ids are digests too). The wire shapes, the
routes' path parameters, the manifest and every blob backend use this one pattern. A name
that is not one is refused with ``InvalidDigest`` (``require_digest``) before anything is
looked up or written: a malformed name is a bad request, never ``DigestMismatch``, which
means bytes that hash to another digest than the one they came with.

Bytes are checked against a digest and, when one is declared, a size by one
``BlobCheck``: it hashes them as they pass, refuses more than the declared size the moment
they pass it (``BlobTooLarge``: a decompression bomb stops there), and at the end refuses
bytes of another length or another hash (``DigestMismatch``, with ``expected`` and
``actual``). Nothing is visible before the check passed: every caller writes to a temp
file or a spool first. The callers:

- ``copy_verified``: a blob backend's ``put`` (``cachekeeper.backends.local``, ``cachekeeper.backends.s3``);
- ``BlobCheck``, ``verify_bytes`` and ``refuse_oversize``: the restore writer
  (``cachekeeper.restore.writer``), which counts a small blob's bytes as it reads them and
  hashes them in its thread pool;
- ``HashingReader``: a blob read back from the object store at publish (``server.packing``);
- ``refuse_oversize``: a restore source whose member declares more bytes than the
  manifest (``cachekeeper.restore.sources``), before a byte of it is read;
- ``hash_file`` and ``digest_of``: the sha256 of a file (a snapshot's files, a restored
  file found in place) or of bytes in memory (the per-key tier's values, ``server/resources/tier.py``,
  named by it when stored and checked against it when read).

Stdlib only and light: the hook's modules import it (through ``cachekeeper.snapshot.manifest``).
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from cachekeeper.errors import BlobTooLarge, DigestMismatch, InvalidDigest

__all__ = [
    "CHUNK_BYTES",
    "DIGEST_PATTERN",
    "BlobCheck",
    "HashingReader",
    "copy_verified",
    "digest_of",
    "hash_file",
    "is_digest",
    "refuse_oversize",
    "require_digest",
    "verify_bytes",
]

CHUNK_BYTES = 1 << 20  # what one read of a file or a blob takes
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


def hash_file(path: Path | int) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, read in ``CHUNK_BYTES`` chunks. An open
    descriptor (an ``int``) is read from where it is, and left open."""
    hasher = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0, closefd=not isinstance(path, int)) as fh:
        while chunk := fh.read(CHUNK_BYTES):
            hasher.update(chunk)
            size += len(chunk)
    return hasher.hexdigest(), size


def digest_of(data: bytes) -> str:
    """The sha256 hex of ``data``."""
    return hashlib.sha256(data).hexdigest()


def _named(digest: str, path: str | None, name: str | None) -> tuple[str, dict[str, Any]]:
    """(what the errors call the bytes, the extra fields they carry): built on failure only."""
    if name is not None:
        return name, {}
    if path is not None:
        return f"blob {digest} for {path}", {"path": path}
    return f"blob {digest}", {}


def refuse_oversize(
    n: int, *, size_bytes: int, digest: str, path: str | None = None, name: str | None = None
) -> None:
    """BlobTooLarge when ``n`` bytes of blob ``digest`` are more than its declared
    ``size_bytes``. The error names ``path`` (the file the blob is for) or ``name``."""
    if n > size_bytes:
        what, extra = _named(digest, path, name)
        raise BlobTooLarge(
            f"{what} is larger than its declared {size_bytes} bytes ({n} or more)", extra=extra
        )


class BlobCheck:
    """Bytes checked against ``digest`` (and ``size_bytes`` when declared) as they pass.

    ``update`` each chunk (BlobTooLarge as soon as more than ``size_bytes`` passed), then
    ``finish`` (DigestMismatch when the bytes are of another length or hash). The errors
    call the bytes ``blob <digest>``, ``blob <digest> for <path>`` (with ``path`` in their
    extra fields: the restore writer's files) or ``name``.
    """

    __slots__ = ("_hasher", "digest", "name", "path", "size_bytes", "total_bytes")

    def __init__(
        self,
        *,
        digest: str,
        size_bytes: int | None = None,
        path: str | None = None,
        name: str | None = None,
    ) -> None:
        self.digest = digest
        self.size_bytes = size_bytes
        self.path = path
        self.name = name
        self.total_bytes = 0
        self._hasher = hashlib.sha256()

    def update(self, chunk: bytes | memoryview) -> None:
        self.total_bytes += len(chunk)
        if self.size_bytes is not None and self.total_bytes > self.size_bytes:
            refuse_oversize(
                self.total_bytes,
                size_bytes=self.size_bytes,
                digest=self.digest,
                path=self.path,
                name=self.name,
            )
        self._hasher.update(chunk)

    def finish(self) -> int:
        """The number of bytes, once they are exactly the ones declared."""
        actual = self._hasher.hexdigest()
        if actual != self.digest or (
            self.size_bytes is not None and self.total_bytes != self.size_bytes
        ):
            what, extra = _named(self.digest, self.path, self.name)
            declared = "" if self.size_bytes is None else f"{self.size_bytes} "
            raise DigestMismatch(
                f"{what} is corrupt: {self.total_bytes} bytes hashing to"
                f" {actual}, expected {declared}bytes hashing to {self.digest}",
                extra={**extra, "expected": self.digest, "actual": actual},
            )
        return self.total_bytes


def verify_bytes(
    data: bytes, *, digest: str, size_bytes: int | None = None, path: str | None = None
) -> None:
    """``BlobCheck`` of bytes already in memory."""
    check = BlobCheck(digest=digest, size_bytes=size_bytes, path=path)
    check.update(data)
    check.finish()


def copy_verified(
    chunks: Iterable[bytes],
    write: Callable[[bytes], object],
    *,
    digest: str,
    size_bytes: int | None = None,
) -> int:
    """Pass ``chunks`` to ``write`` while checking them (``BlobCheck``); their length, once
    they are exactly the blob ``digest`` names.

    The check every blob backend's ``put`` makes before a blob becomes visible: on an
    error the caller stores nothing (what ``write`` wrote is a temp file or a spool).
    """
    check = BlobCheck(digest=digest, size_bytes=size_bytes)
    for chunk in chunks:
        check.update(chunk)
        write(chunk)
    return check.finish()


class HashingReader(io.RawIOBase):
    """``body`` read through a ``BlobCheck`` of exactly ``size_bytes``; ``check()`` once read.

    A read past ``size_bytes``, or an end of ``body`` before it, fails at once (a reader
    such as a zstd compressor told the size never sees other bytes). ``refuse`` turns the
    check's error into the caller's own (publish: ``server.packing``'s ``BlobMissing``).
    """

    def __init__(
        self,
        body: BinaryIO,
        *,
        digest: str,
        size_bytes: int,
        name: str | None = None,
        refuse: Callable[[DigestMismatch], Exception] | None = None,
    ) -> None:
        super().__init__()
        self._body = body
        self._check = BlobCheck(digest=digest, size_bytes=size_bytes, name=name)
        self._refuse = refuse

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        try:
            self._check.update(data)
            if not n and len(buffer) and self._check.total_bytes < (self._check.size_bytes or 0):
                self._check.finish()  # the body ended early: fails here
        except DigestMismatch as exc:
            if self._refuse is None:
                raise
            raise self._refuse(exc) from exc
        return n

    def check(self) -> None:
        """Fail unless every byte was read and they are the ones ``digest`` names."""
        try:
            self._check.finish()
        except DigestMismatch as exc:
            if self._refuse is None:
                raise
            raise self._refuse(exc) from exc

    def close(self) -> None:
        self._body.close()
        super().close()
