"""The blobs resource (``/v1/blobs``): which blobs are missing, uploads (hash-checked),
downloads; its service ``Blobs`` and its queries (the ``blobs`` table).

A blob's bytes live in the blob backend (``cachekeeper/backends/``: the local directory or
the object store), its row in the catalog: digest, uncompressed and stored sizes, when it
was created and last used (GC's grace period is measured on it). ``Blobs`` asks its backend
for direct access once (at construction) and never for its class.

Ordering rules that keep a crash harmless: a blob's row is written only after the backend
made its bytes visible (a crash before leaves at most a temp file, or a file with no row
that GC removes), and under the catalog's write lock after checking the file is there (GC
deletes files only under that lock, after their rows: pointers before blobs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from cachekeeper.backends.base import BlobBackend, DirectAccess, PutResult
from cachekeeper.errors import BlobMissing, PayloadTooLarge, ServerUnavailable
from cachekeeper.server.catalog import Catalog, Transaction, chunks
from cachekeeper.server.settings import Settings
from cachekeeper.wire import Upload, utc_now

__all__ = [
    "BlobInfo",
    "BlobUsage",
    "Blobs",
    "StoredBlob",
    "blob_info",
    "blob_last_access",
    "blob_row_digests",
    "blob_sizes",
    "blob_usage",
    "delete_blob_rows",
    "delete_unused_blob_rows",
    "limit_size",
    "missing_blob_rows",
    "record_blob",
    "store_bytes",
]


@dataclass(frozen=True)
class StoredBlob:
    digest: str
    size_bytes: int  # uncompressed
    stored_bytes: int  # as stored


@dataclass(frozen=True)
class BlobInfo:
    digest: str
    size_bytes: int  # uncompressed
    stored_bytes: int  # as stored (zstd)
    created_at: str
    last_access_at: str


@dataclass(frozen=True)
class BlobUsage:
    """What a GC plan needs of one blob row."""

    digest: str
    stored_bytes: int
    last_access_at: str
    refs: int  # snapshots referencing it


def limit_size(chunks: Iterable[bytes], *, max_bytes: int, what: str) -> Iterator[bytes]:
    """Pass ``chunks`` through, raising PayloadTooLarge once more than ``max_bytes`` went by."""
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > max_bytes:
            raise PayloadTooLarge(f"{what} is over the server's limit of {max_bytes} bytes")
        yield chunk


class Blobs:
    """The blobs as the routes see them: the backend's bytes with the catalog's rows."""

    def __init__(
        self,
        *,
        settings: Settings,
        catalog: Catalog,
        backend: BlobBackend,
        direct: DirectAccess | None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.backend = backend
        self.direct = direct  # the backend's direct access, asked once by its builder

    def missing(self, digests: Iterable[str]) -> list[str]:
        """Which of ``digests`` the server does not have, in the order given: no row, or a
        row whose bytes are gone (so a push uploads it again rather than skip it)."""
        wanted = list(dict.fromkeys(digests))
        present = blob_sizes(self.catalog, wanted)
        return [d for d in wanted if d not in present or self.backend.stat(d) is None]

    def upload_targets(self, digests: Iterable[str]) -> list[Upload]:
        """Where nodes PUT ``digests`` themselves (direct access); else none: they upload
        through the server. Publish hashes what they uploaded regardless."""
        if self.direct is None:
            return []
        expires = self.settings.presign_expires_s
        return [self.direct.upload_target(d, expires_s=expires) for d in digests]

    def get(self, digest: str) -> StoredBlob | None:
        """The blob's sizes when both its row and its bytes are there."""
        info = blob_info(self.catalog, digest)
        stat = self.backend.stat(digest)
        if info is None or stat is None:
            return None
        return StoredBlob(digest, info.size_bytes, stat.stored_bytes)

    def has_bytes(self, digest: str) -> bool:
        """Whether the backend holds the blob's bytes (row or not)."""
        return self.backend.stat(digest) is not None

    def stored_bytes(self) -> int:
        """Stored (compressed) bytes of every blob with a row: what the cap counts."""
        return store_bytes(self.catalog)

    def open(self, digest: str) -> BinaryIO:
        return self.backend.open(digest)

    def open_raw(self, digest: str) -> BinaryIO:
        return self.backend.open_raw(digest)

    def put(self, digest: str, chunks: Iterable[bytes]) -> PutResult:
        """Store the uncompressed ``chunks`` as blob ``digest`` (hash-checked), then its row."""
        limited = limit_size(chunks, max_bytes=self.settings.max_blob_bytes, what="blob")
        result = self.backend.put(limited, digest=digest)
        collected = ServerUnavailable(f"blob {digest} was collected while uploading; retry")
        size = result.size_bytes
        if not result.created:
            info = blob_info(self.catalog, digest)
            try:
                size = info.size_bytes if info else _uncompressed_size(self.backend, digest)
            except BlobMissing as exc:
                raise collected from exc
        with self.catalog.writing() as tx:
            # GC deletes files only under this lock: the file seen here stays with its row.
            stat = self.backend.stat(digest)
            if stat is None:
                raise collected
            record_blob(tx, digest=digest, size_bytes=size, stored_bytes=stat.stored_bytes)
        return PutResult(digest, size, stat.stored_bytes, result.created)


# -- queries: the blobs table ----------------------------------------------------------


def missing_blob_rows(tx: Transaction, digests: Iterable[str]) -> list[str]:
    """The ``digests`` that have no blob row, sorted."""
    wanted = sorted(set(digests))
    present: set[str] = set()
    for part, marks in chunks(wanted):
        sql = f"SELECT digest FROM blobs WHERE digest IN ({marks})"
        present.update(r[0] for r in tx.db.execute(sql, part))
    return [d for d in wanted if d not in present]


def record_blob(tx: Transaction, *, digest: str, size_bytes: int, stored_bytes: int) -> None:
    now = utc_now()
    tx.db.execute(
        "INSERT INTO blobs (digest, size_bytes, stored_bytes, created_at, last_access_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT(digest) DO UPDATE SET"
        " last_access_at = excluded.last_access_at",
        [digest, size_bytes, stored_bytes, now, now],
    )


def blob_last_access(tx: Transaction, digest: str) -> str | None:
    """The row's ``last_access_at`` ('' when never set), or None when there is no row."""
    found = tx.db.execute("SELECT last_access_at FROM blobs WHERE digest = ?", [digest])
    row = found.fetchone()
    return None if row is None else (row[0] or "")


def delete_unused_blob_rows(
    tx: Transaction, digests: Iterable[str], *, unused_since: str
) -> dict[str, int]:
    """Delete the rows of ``digests`` that nothing references and nobody used after
    ``unused_since``; {digest: stored bytes} of those deleted."""
    gone: dict[str, int] = {}
    for part, marks in chunks(sorted(set(digests))):
        rows = tx.db.execute(
            f"SELECT digest, stored_bytes FROM blobs WHERE digest IN ({marks})"
            " AND COALESCE(last_access_at, '') <= ? AND NOT EXISTS"
            " (SELECT 1 FROM snapshot_blobs sb WHERE sb.digest = blobs.digest)",
            [*part, unused_since],
        )
        gone.update((r[0], int(r[1])) for r in rows)
    delete_blob_rows(tx, gone)
    return gone


def delete_blob_rows(tx: Transaction, digests: Iterable[str]) -> None:
    for part, marks in chunks(sorted(set(digests))):
        tx.db.execute(f"DELETE FROM blobs WHERE digest IN ({marks})", part)


def blob_row_digests(tx: Transaction) -> set[str]:
    return {r[0] for r in tx.db.execute("SELECT digest FROM blobs")}


def blob_info(catalog: Catalog, digest: str) -> BlobInfo | None:
    found = catalog.rows("SELECT * FROM blobs WHERE digest = ?", [digest])
    if not found:
        return None
    row = found[0]
    return BlobInfo(
        digest=row["digest"],
        size_bytes=int(row["size_bytes"]),
        stored_bytes=int(row["stored_bytes"]),
        created_at=row["created_at"],
        last_access_at=row["last_access_at"] or "",
    )


def blob_sizes(catalog: Catalog, digests: Iterable[str]) -> dict[str, int]:
    """{digest: uncompressed size} for the digests that have a row."""
    out: dict[str, int] = {}
    for part, marks in chunks(list(dict.fromkeys(digests))):
        sql = f"SELECT digest, size_bytes FROM blobs WHERE digest IN ({marks})"
        out.update((r["digest"], r["size_bytes"]) for r in catalog.rows(sql, part))
    return out


def blob_usage(catalog: Catalog) -> list[BlobUsage]:
    """Every blob row with its stored size, last use and reference count."""
    rows = catalog.rows(
        "SELECT b.digest AS digest, b.stored_bytes AS stored, b.last_access_at AS at,"
        " COUNT(sb.snapshot_id) AS refs FROM blobs b"
        " LEFT JOIN snapshot_blobs sb ON sb.digest = b.digest GROUP BY b.digest"
    )
    return [BlobUsage(r["digest"], int(r["stored"]), r["at"] or "", int(r["refs"])) for r in rows]


def store_bytes(catalog: Catalog) -> int:
    row = catalog.rows("SELECT COALESCE(SUM(stored_bytes), 0) AS n FROM blobs")[0]
    return int(row["n"])


def _uncompressed_size(blobs: BlobBackend, digest: str) -> int:
    total = 0
    with blobs.open(digest) as fh:
        while chunk := fh.read(1 << 20):
            total += len(chunk)
    return total
