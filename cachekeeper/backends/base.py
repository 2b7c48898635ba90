"""The blob backend interface: what the server and the local store need of the place blob
bytes live.

As in bazel-remote (``cache/cache.go`` is the interface; ``cache/disk``, ``cache/s3proxy``,
``cache/gcsproxy`` each implement it in their own package), the server's resources
(``server/resources/``: blobs, snapshots, GC, the per-key tier) and packing
(``server/packing.py``) depend on this interface alone and never ask which backend they
hold. Each backend is one module of this folder:

- ``cachekeeper/backends/local.py`` ``LocalBackend``: a local directory (``<data>/blobs``
  on the server, the default; ``$CACHEKEEPER_HOME/blobs`` for a node's local store);
- ``cachekeeper/backends/s3.py`` ``S3Backend``: an S3-compatible object store
  (``s3://BUCKET/PREFIX``).

``cachekeeper/backends/registry.py`` maps a URL scheme to its opener: the one table that
both the server's settings (is ``--blob-store`` a URL a backend opens?) and the server's
composition root (``open_backend``) read. A new backend (GCS, Azure, a shared filesystem)
is one new module whose class has these methods, and its entry there
(``tests/core/backends/test_base.py`` runs the snapshot path on a third, in-memory one).

Blobs are named by the sha256 of their uncompressed bytes (``cachekeeper.integrity``). A
backend's ``put`` checks the bytes while they stream (``integrity.copy_verified``) and makes
the blob visible only once complete and right; ``stat`` and ``scan`` give the stored size
and age, which GC's grace period is measured on. A miss is a value (``stat`` is None), and
``open`` of a missing blob raises ``BlobMissing``.

**Direct access** is optional: a backend whose bytes nodes reach by URL, without the server
in the path (the object store, through presigned URLs), returns itself from
``direct_access()``; one without (the local directory) returns None. The server asks once,
when it builds its resources. Direct access brings three things: upload targets (a node
PUTs a blob into the store itself), one archive object per snapshot (written at publish,
read by nodes with an archive URL), and, because the store may not have checked what nodes
uploaded, publish reads every blob back and hashes it (``server/packing.py``, which needs
``open_dated`` and ``stat_many``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from cachekeeper.wire import Upload

__all__ = ["BlobBackend", "BlobStat", "DirectAccess", "PutResult"]


@dataclass(frozen=True)
class PutResult:
    digest: str
    size_bytes: int
    stored_bytes: int
    created: bool  # False when the blob was already there


@dataclass(frozen=True)
class BlobStat:
    digest: str
    stored_bytes: int  # as stored (zstd)
    modified_at: float  # UTC, seconds since the epoch


class BlobBackend(Protocol):
    """Where blob bytes live (see the module docstring)."""

    def put(
        self, chunks: Iterable[bytes], *, digest: str, size_bytes: int | None = None
    ) -> PutResult:
        """Store the uncompressed ``chunks`` as blob ``digest`` once they hash right;
        ``created`` False when it was there already. Raises DigestMismatch, BlobTooLarge,
        InsufficientStorage, and stores nothing then."""
        ...

    def open(self, digest: str) -> BinaryIO:
        """The uncompressed bytes; raises BlobMissing."""
        ...

    def open_raw(self, digest: str) -> BinaryIO:
        """The bytes as one zstd frame (what the archive stream splices); raises BlobMissing."""
        ...

    def stat(self, digest: str) -> BlobStat | None:
        """Stored size and age; None when absent."""
        ...

    def delete(self, digest: str) -> bool:
        """Remove the blob; False when it was not there."""
        ...

    def scan(self) -> Iterator[BlobStat]:
        """Every stored blob, with its stored size and age."""
        ...

    def direct_access(self) -> DirectAccess | None:
        """This backend's direct access, or None when nodes go through the server."""
        ...


class DirectAccess(BlobBackend, Protocol):
    """A backend nodes reach without the server: upload targets, archive objects, and the
    reads publish checks uploaded blobs with."""

    def upload_target(self, digest: str, *, expires_s: int) -> Upload:
        """Where a node PUTs blob ``digest`` itself (a URL and the headers it must send)."""
        ...

    def blob_url(self, digest: str, *, expires_s: int) -> str:
        """A URL a node GETs blob ``digest``'s bytes from (a per-key tier value)."""
        ...

    def archive_url(self, snapshot_id: str, *, expires_s: int) -> str:
        """A URL a node GETs the snapshot's archive object from."""
        ...

    def put_archive(self, snapshot_id: str, path: Path) -> tuple[int, str]:
        """Upload the archive file at ``path``; (its size in bytes, the object's ETag)."""
        ...

    def archive_etag(self, snapshot_id: str) -> str | None:
        """The archive object's ETag now (None: there is none); any rewrite changes it."""
        ...

    def open_archive(self, snapshot_id: str) -> BinaryIO:
        """The archive object's bytes; raises BlobMissing."""
        ...

    def delete_archive(self, snapshot_id: str) -> bool: ...

    def archives(self) -> Iterator[BlobStat]:
        """Every archive object, named by its snapshot id, with its size and age."""
        ...

    def open_dated(self, digest: str) -> tuple[BinaryIO, float]:
        """The blob's bytes and its object's last-modified time (one read); BlobMissing."""
        ...

    def stat_many(self, digests: Iterable[str]) -> dict[str, BlobStat | None]:
        """``stat`` of each of ``digests``, looked up concurrently."""
        ...
