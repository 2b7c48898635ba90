"""The snapshots resource (``/v1/snapshots``): publish, list, fetch, the archive stream,
pin, delete, and the start-up check; its service ``Snapshots`` and its queries (the
``snapshots``, ``snapshot_blobs``, ``archive_objects``, ``quarantine`` and ``events``
tables).

A snapshot's manifest and its references to blobs are rows of the catalog; its blobs are
the blobs resource's (``server/resources/blobs.py``); with direct access (the object
store), one archive object per snapshot is written at publish (``server/packing.py``) and
nodes download it by URL. Every publish is checked against the snapshots' budget in the
same transaction as its row (``server/budgets.py``).

Ordering rules that keep a crash harmless: a snapshot row appears in one transaction after
every blob it names has a row; deletion removes rows (pointers) before files, and blobs no
snapshot references any more go at the next GC (``server/resources/gc.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from cachekeeper.backends.base import BlobBackend, BlobStat, DirectAccess
from cachekeeper.environment.fingerprint import Fingerprint
from cachekeeper.errors import BlobMissing, InvalidManifest, SnapshotNotFound
from cachekeeper.server.archive import archive_chunks
from cachekeeper.server.budgets import Budgets
from cachekeeper.server.catalog import BATCH, Catalog, Transaction
from cachekeeper.server.packing import Packed, SnapshotLocks, pack_snapshot
from cachekeeper.server.settings import Settings
from cachekeeper.snapshot.manifest import Manifest
from cachekeeper.wire import Summary, utc_now

from .blobs import (
    blob_row_digests,
    blob_sizes,
    delete_blob_rows,
    missing_blob_rows,
    record_blob,
)

__all__ = [
    "CLOCK_MARGIN_S",
    "SUMMARY_COLUMNS",
    "CheckReport",
    "Counts",
    "Snapshots",
    "add_event",
    "delete_snapshot",
    "list_summaries",
    "lru_unpinned",
    "manifest_text",
    "snapshot_blobs",
    "snapshot_exists",
    "stored_fingerprint",
    "summary",
    "summary_of",
    "touch_snapshot",
]

CLOCK_MARGIN_S = 60.0  # _record_checked: how far the server's clock may step back

SUMMARY_COLUMNS = (
    "id, workload, fingerprint_digest, devices, verified, signed, size_bytes, file_count, "
    "created_at, last_used_at, pinned, source, parent"
)


@dataclass(frozen=True)
class Counts:
    snapshots: int
    blobs: int
    stored_bytes: int


@dataclass(frozen=True)
class CheckReport:
    """What ``Snapshots.check`` changed at start-up."""

    stale_blob_rows: int  # rows dropped: their bytes were gone
    completed: tuple[str, ...]  # snapshots whose missing references were added
    quarantined: tuple[str, ...]  # snapshots taken out of service: blobs are gone


class Snapshots:
    """The snapshots as the routes see them: published manifests, their archives."""

    def __init__(
        self,
        *,
        settings: Settings,
        catalog: Catalog,
        backend: BlobBackend,
        direct: DirectAccess | None,
        budgets: Budgets,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.backend = backend
        self.direct = direct  # the backend's direct access, asked once by its builder
        self.budgets = budgets
        self.packs = 0  # archive objects packed by publish since start (for /metrics)
        self._publishing = SnapshotLocks()  # one publish of a snapshot at a time (packing.py)

    def get(self, snapshot_id: str) -> Summary:
        found = summary(self.catalog, snapshot_id)
        if found is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id} on this server")
        return found

    def summaries(
        self,
        *,
        workload: str | None = None,
        fingerprint_digest: str | None = None,
        verified: bool | None = None,
        limit: int = 1000,
    ) -> list[Summary]:
        """Snapshots, newest published first, optionally filtered."""
        return list_summaries(
            self.catalog,
            workload=workload,
            fingerprint_digest=fingerprint_digest,
            verified=verified,
            limit=limit,
        )

    def manifest_text(self, snapshot_id: str) -> str:
        """The manifest JSON as published (signature included)."""
        text = manifest_text(self.catalog, snapshot_id)
        if text is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id} on this server")
        return text

    def archive(
        self,
        snapshot_id: str,
        *,
        digests: Iterable[str] | None = None,
        on_blob: Callable[[str], None] | None = None,
    ) -> Iterator[bytes]:
        """The snapshot (or only ``digests`` of it) as one archive stream; marks it used."""
        text = self.manifest_text(snapshot_id)
        sizes = snapshot_blobs(self.catalog, snapshot_id)
        order = list(dict.fromkeys(f["digest"] for f in json.loads(text)["files"]))
        if digests is not None:
            chosen = set(digests)
            order = [d for d in order if d in chosen]
        with self.catalog.writing() as tx:
            touch_snapshot(tx, snapshot_id)
        direct = self.direct
        if direct is not None and len(order) == len(sizes):
            # The whole snapshot: its archive object as written at publish (no recompression),
            # unless it was changed behind our back: then the stream is built from the blobs.
            if self._archive_intact(direct, snapshot_id):
                return _read_chunks(direct.open_archive(snapshot_id))
        return archive_chunks(
            manifest_json=text.encode(),
            blobs=[(d, sizes[d]) for d in order],
            store=self.backend,
            level=self.settings.archive_level,
            on_blob=on_blob,
        )

    def archive_url(self, snapshot_id: str) -> str | None:
        """Where nodes GET the snapshot's archive object (direct access only)."""
        if self.direct is None:
            return None
        return self.direct.archive_url(snapshot_id, expires_s=self.settings.presign_expires_s)

    def touch(self, snapshot_id: str) -> None:
        """Mark the snapshot used now (resolve's hit; LRU eviction goes by it)."""
        with self.catalog.writing() as tx:
            touch_snapshot(tx, snapshot_id)

    def set_pinned(self, snapshot_id: str, *, pinned: bool) -> Summary:
        with self.catalog.writing() as tx:
            if not set_pinned(tx, snapshot_id, pinned=pinned):
                raise SnapshotNotFound(f"no snapshot {snapshot_id} on this server")
        return self.get(snapshot_id)

    def delete(self, snapshot_id: str) -> None:
        """Remove a snapshot (pointers only); blobs no other snapshot uses go at the next GC."""
        with self.catalog.writing() as tx:
            if not delete_snapshot(tx, snapshot_id):
                raise SnapshotNotFound(f"no snapshot {snapshot_id} on this server")

    def publish(self, manifest: Manifest) -> tuple[Summary, bool]:
        """Record ``manifest`` as a snapshot; (summary, created). Idempotent by id.

        One transaction: the snapshot row, every blob reference and the event appear
        together or not at all. Publishing a snapshot that exists completes it if it lacks
        references (a half-published row left by an older server) and keeps a signature
        it did not have; it answers ``created`` False. A publish of a snapshot being
        published waits for that one (a client retrying a slow publish packs nothing twice).
        """
        self.budgets.retain(self.catalog)  # the audit log grows with publishes
        with self._publishing.hold(manifest.id):
            return self._publish(manifest)

    def _publish(self, manifest: Manifest) -> tuple[Summary, bool]:
        snapshot_id = manifest.id
        with self.catalog.writing() as tx:  # refused before packing, not after
            self.budgets.admit_snapshot(tx, manifest)
        checked = self._pack(manifest)
        sizes = checked.sizes if checked is not None else blob_sizes(self.catalog, manifest.digests)
        missing = sorted(manifest.digests - sizes.keys())
        if missing:
            raise BlobMissing(
                f"{len(missing)} blob(s) of snapshot {snapshot_id[:12]} are not on the server",
                extra={"missing": missing},
            )
        for entry in manifest.files:
            if sizes[entry.digest] != entry.size_bytes:
                raise InvalidManifest(
                    f"{entry.path}: size_bytes {entry.size_bytes} does not match blob"
                    f" {entry.digest[:12]} ({sizes[entry.digest]} bytes)"
                )
        with self.catalog.writing() as tx:
            if checked is not None and self.direct is not None:  # packed: direct access
                _record_checked(tx, self.direct, checked, grace_s=self.settings.gc_grace_s)
                record_archive(
                    tx, snapshot_id, etag=checked.archive_etag, size_bytes=checked.archive_bytes
                )
            # A GC may have run since the check above: re-check inside the transaction.
            created = not snapshot_exists(tx, snapshot_id)
            absent = set(manifest.digests)
            if not created:
                absent -= referenced_digests(tx, snapshot_id)
            still = missing_blob_rows(tx, absent)
            if still:
                raise BlobMissing(
                    f"{len(still)} blob(s) of snapshot {snapshot_id[:12]} were collected",
                    extra={"missing": still},
                )
            if created:
                self.budgets.admit_snapshot(tx, manifest)
                insert_snapshot(tx, manifest, created_at=utc_now())
            else:
                if manifest.signature is not None:
                    # The same snapshot, now signed: keep the signature (the id is unchanged).
                    sign_snapshot(tx, snapshot_id, manifest_json=manifest.to_json())
                if absent:
                    add_references(tx, snapshot_id, absent, at=utc_now())
                    add_event(
                        tx, kind="snapshot.completed", subject=snapshot_id, detail=len(absent)
                    )
        return self.get(snapshot_id), created

    def _pack(self, manifest: Manifest) -> Packed | None:
        """Direct access: hash every blob there and write the archive object; else None.

        Skipped (None) for a snapshot published before whose archive object is there as
        this server wrote it (``_archive_intact``) and whose manifest does not change (a
        re-push); a newly added signature rewrites it, and so does an archive object that
        is gone or was changed behind the server's back: the re-push repairs it.
        """
        if self.direct is None:
            return None
        existing = summary(self.catalog, manifest.id)
        if existing is not None and self._archive_intact(self.direct, manifest.id):
            if manifest.signature is None or existing.signed:
                return None
        packed = pack_snapshot(
            self.direct,
            manifest,
            tmp_dir=self.settings.data_dir / "tmp",
            level=self.settings.archive_level,
        )
        self.packs += 1
        return packed

    def _archive_intact(self, direct: DirectAccess, snapshot_id: str) -> bool:
        """Whether the snapshot's archive object is the one this server wrote (its ETag)."""
        recorded = archive_etag(self.catalog, snapshot_id)
        return recorded is not None and direct.archive_etag(snapshot_id) == recorded

    def check(self) -> CheckReport:
        """The start-up check: make every row agree with what is stored.

        Blob rows whose bytes are gone are dropped. A snapshot that references fewer blobs
        than its manifest names (a publish cut short by an older server) is completed when
        every blob is there, and quarantined otherwise (``quarantine`` table; a re-push of
        the same manifest publishes it again). One transaction.
        """
        present = {s.digest for s in self.backend.scan()}
        repaired: list[str] = []
        quarantined: list[str] = []
        with self.catalog.writing() as tx:
            stale = blob_row_digests(tx) - present
            delete_blob_rows(tx, stale)
            for snapshot_id in incomplete_suspects(tx):
                text = manifest_text_in(tx, snapshot_id) or '{"files": []}'
                digests = {f["digest"] for f in json.loads(text)["files"]}
                gone = missing_blob_rows(tx, digests)
                if gone:
                    reason = f"{len(gone)} of its {len(digests)} blob(s) are not on the server"
                    quarantine_snapshot(tx, snapshot_id, reason=reason)
                    quarantined.append(snapshot_id)
                elif digests - referenced_digests(tx, snapshot_id):
                    add_references(tx, snapshot_id, digests, at=utc_now())
                    add_event(tx, kind="snapshot.completed", subject=snapshot_id, detail=None)
                    repaired.append(snapshot_id)
        return CheckReport(len(stale), tuple(repaired), tuple(quarantined))

    def counts(self) -> Counts:
        """Snapshots, blob rows and their stored bytes (for /metrics)."""
        return counts(self.catalog)

    def fingerprint_of(self, fingerprint_digest: str) -> Fingerprint | None:
        """The full fingerprint a stored snapshot records for ``fingerprint_digest``."""
        return fingerprint_of(self.catalog, fingerprint_digest)


def _record_checked(
    tx: Transaction, store: DirectAccess, packed: Packed, *, grace_s: float
) -> None:
    """Rows for blobs a node uploaded to the object store, checked by ``pack_snapshot``.

    Called under the catalog's write lock (``tx``). GC deletes an object that has no row
    only when, looked up under the same lock, it is older than ``grace_s``: an object
    modified less than ``grace_s`` (minus ``CLOCK_MARGIN_S``) before now was not taken since
    ``pack_snapshot`` read it, and is recorded as read. An older one is looked up once more
    (HEAD), so an object GC took since the check refuses the publish (BlobMissing: the push
    uploads it again) instead of being recorded. (A push publishes what it just uploaded,
    so a publish usually looks nothing up while it holds the lock.)
    """
    new = missing_blob_rows(tx, packed.sizes)
    fresh_after = time.time() - grace_s + CLOCK_MARGIN_S
    found = store.stat_many(d for d in new if packed.modified_at.get(d, 0.0) < fresh_after)
    gone = []
    for digest in new:
        stat = found.get(digest, BlobStat(digest, packed.sizes[digest], 0.0))
        if stat is None:
            gone.append(digest)
        else:
            record_blob(
                tx, digest=digest, size_bytes=packed.sizes[digest], stored_bytes=stat.stored_bytes
            )
    if gone:
        raise BlobMissing(
            f"{len(gone)} blob(s) were collected from the object store while publishing;"
            " upload them again",
            extra={"missing": gone},
        )


def _read_chunks(fh: BinaryIO, chunk_bytes: int = 4 << 20) -> Iterator[bytes]:
    with fh:
        while chunk := fh.read(chunk_bytes):
            yield chunk


# -- queries: the snapshots, their blob references, archive objects, events ------------


def stored_fingerprint(text: str) -> Fingerprint:
    """A snapshot row's fingerprint: checked (``fingerprint.parse``) when its manifest was
    published; a server before the typed fingerprint checked only that it was an object,
    so readers of stored rows (resolve, the status page) read them with ``get``."""
    return cast(Fingerprint, json.loads(text))


def summary_of(row: dict[str, Any]) -> Summary:
    return Summary(
        id=row["id"],
        workload=row["workload"],
        fingerprint_digest=row["fingerprint_digest"],
        devices=tuple(json.loads(row["devices"] or "[]")),
        verified=bool(row["verified"]),
        signed=bool(row["signed"]),
        size_bytes=row["size_bytes"],
        file_count=row["file_count"],
        created_at=row["created_at"],
        last_used_at=row["last_used_at"],
        pinned=bool(row["pinned"]),
        source=row["source"],
        parent=row["parent"],
    )


def snapshot_exists(tx: Transaction, snapshot_id: str) -> bool:
    return tx.one("SELECT 1 FROM snapshots WHERE id = ?", [snapshot_id]) is not None


def referenced_digests(tx: Transaction, snapshot_id: str) -> set[str]:
    sql = "SELECT digest FROM snapshot_blobs WHERE snapshot_id = ?"
    return {r[0] for r in tx.db.execute(sql, [snapshot_id])}


def insert_snapshot(tx: Transaction, manifest: Manifest, *, created_at: str) -> None:
    """The snapshot's row, its blob references, and a ``snapshot.published`` event."""
    tx.db.table("snapshots").insert(
        {
            "id": manifest.id,
            "workload": manifest.workload,
            "fingerprint_digest": manifest.fingerprint_digest,
            "fingerprint": json.dumps(manifest.fingerprint, sort_keys=True),
            "devices": json.dumps(list(manifest.devices)),
            "verified": int(manifest.verified),
            "signed": int(manifest.signature is not None),
            "stats": json.dumps(manifest.stats, sort_keys=True),
            "size_bytes": manifest.size_bytes,
            "file_count": len(manifest.files),
            "created_at": created_at,
            "last_used_at": None,
            "pinned": 0,
            "manifest": manifest.to_json(),
            "source": manifest.source,
            "parent": manifest.parent,
            "workload_digest": manifest.workload_digest,
        }
    )
    add_references(tx, manifest.id, manifest.digests, at=created_at)
    add_event(tx, kind="snapshot.published", subject=manifest.id, detail=manifest.workload)


def add_references(tx: Transaction, snapshot_id: str, digests: Iterable[str], *, at: str) -> None:
    """Reference ``digests`` from the snapshot (idempotent) and mark them used ``at``."""
    tx.db.table("snapshot_blobs").insert_all(
        ({"snapshot_id": snapshot_id, "digest": d} for d in sorted(set(digests))),
        batch_size=BATCH,
        ignore=True,
    )
    tx.db.execute(
        "UPDATE blobs SET last_access_at = ? WHERE digest IN"
        " (SELECT digest FROM snapshot_blobs WHERE snapshot_id = ?)",
        [at, snapshot_id],
    )


def sign_snapshot(tx: Transaction, snapshot_id: str, *, manifest_json: str) -> None:
    """Store the signed manifest of an unsigned snapshot (the id does not change)."""
    tx.db.execute(
        "UPDATE snapshots SET manifest = ?, signed = 1 WHERE id = ? AND signed = 0",
        [manifest_json, snapshot_id],
    )


def touch_snapshot(tx: Transaction, snapshot_id: str) -> None:
    sql = "UPDATE snapshots SET last_used_at = ? WHERE id = ?"
    tx.db.execute(sql, [utc_now(), snapshot_id])


def set_pinned(tx: Transaction, snapshot_id: str, *, pinned: bool) -> bool:
    sql = "UPDATE snapshots SET pinned = ? WHERE id = ?"
    return tx.db.execute(sql, [int(pinned), snapshot_id]).rowcount > 0


def delete_snapshot(tx: Transaction, snapshot_id: str, *, only_unpinned: bool = False) -> bool:
    """Remove a snapshot's row and references (blobs stay for GC); False if not there
    (or pinned, with ``only_unpinned``)."""
    pinned_clause = " AND pinned = 0" if only_unpinned else ""
    sql = f"SELECT 1 FROM snapshots WHERE id = ?{pinned_clause}"
    if tx.one(sql, [snapshot_id]) is None:
        return False
    tx.db.execute("DELETE FROM snapshot_blobs WHERE snapshot_id = ?", [snapshot_id])
    tx.db.execute("DELETE FROM archive_objects WHERE snapshot_id = ?", [snapshot_id])
    tx.db.execute("DELETE FROM snapshots WHERE id = ?", [snapshot_id])
    return True


def record_archive(tx: Transaction, snapshot_id: str, *, etag: str, size_bytes: int) -> None:
    """The object-store archive of ``snapshot_id`` as this server wrote it."""
    tx.db.execute(
        "INSERT INTO archive_objects (snapshot_id, etag, size_bytes) VALUES (?, ?, ?)"
        " ON CONFLICT(snapshot_id) DO UPDATE SET etag = excluded.etag,"
        " size_bytes = excluded.size_bytes",
        [snapshot_id, etag, size_bytes],
    )


def manifest_text_in(tx: Transaction, snapshot_id: str) -> str | None:
    found = tx.db.execute("SELECT manifest FROM snapshots WHERE id = ?", [snapshot_id])
    row = found.fetchone()
    return None if row is None else str(row[0])


def incomplete_suspects(tx: Transaction) -> list[str]:
    """Snapshots that may reference fewer blobs than their manifest names: fewer
    references than files (exact only after parsing: files may share a blob), or a
    reference to a blob with no row."""
    rows = tx.db.execute(
        "SELECT s.id FROM snapshots s LEFT JOIN (SELECT snapshot_id, COUNT(*) AS n"
        " FROM snapshot_blobs GROUP BY snapshot_id) r ON r.snapshot_id = s.id"
        " WHERE COALESCE(r.n, 0) < s.file_count"
        " UNION SELECT sb.snapshot_id FROM snapshot_blobs sb"
        " LEFT JOIN blobs b ON b.digest = sb.digest WHERE b.digest IS NULL"
    )
    return sorted(r[0] for r in rows)


def quarantine_snapshot(tx: Transaction, snapshot_id: str, *, reason: str) -> None:
    """Take a snapshot out of service, keeping its manifest in ``quarantine``."""
    manifest = manifest_text_in(tx, snapshot_id) or ""
    tx.db.execute(
        "INSERT INTO quarantine (id, at, reason, manifest) VALUES (?, ?, ?, ?)"
        " ON CONFLICT(id) DO UPDATE SET at = excluded.at, reason = excluded.reason,"
        " manifest = excluded.manifest",
        [snapshot_id, utc_now(), reason, manifest],
    )
    delete_snapshot(tx, snapshot_id)
    add_event(tx, kind="snapshot.quarantined", subject=snapshot_id, detail=reason)


def add_event(tx: Transaction, *, kind: str, subject: str, detail: Any) -> None:
    tx.db.execute(
        "INSERT INTO events (at, kind, subject, detail) VALUES (?, ?, ?, ?)",
        [utc_now(), kind, subject, json.dumps(detail, sort_keys=True)],
    )


def summary(catalog: Catalog, snapshot_id: str) -> Summary | None:
    sql = f"SELECT {SUMMARY_COLUMNS} FROM snapshots WHERE id = ?"
    found = catalog.rows(sql, [snapshot_id])
    return summary_of(found[0]) if found else None


def manifest_text(catalog: Catalog, snapshot_id: str) -> str | None:
    found = catalog.rows("SELECT manifest FROM snapshots WHERE id = ?", [snapshot_id])
    return str(found[0]["manifest"]) if found else None


def list_summaries(
    catalog: Catalog,
    *,
    workload: str | None = None,
    fingerprint_digest: str | None = None,
    verified: bool | None = None,
    limit: int = 1000,
) -> list[Summary]:
    where: list[str] = []
    params: list[Any] = []
    for column, value in (
        ("workload", workload),
        ("fingerprint_digest", fingerprint_digest),
        ("verified", None if verified is None else int(verified)),
    ):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    sql = (  # newest first by order of publication (rowid), whatever the clock said
        f"SELECT {SUMMARY_COLUMNS} FROM snapshots {clause} ORDER BY rowid DESC LIMIT ?"
    )
    return [summary_of(r) for r in catalog.rows(sql, [*params, limit])]


def archive_etag(catalog: Catalog, snapshot_id: str) -> str | None:
    """The ETag of the archive object this server wrote for ``snapshot_id``, if any."""
    found = catalog.rows("SELECT etag FROM archive_objects WHERE snapshot_id = ?", [snapshot_id])
    return str(found[0]["etag"]) if found else None


def snapshot_blobs(catalog: Catalog, snapshot_id: str) -> dict[str, int]:
    """{digest: uncompressed size} of a snapshot's distinct blobs."""
    rows = catalog.rows(
        "SELECT sb.digest AS digest, b.size_bytes AS size_bytes FROM snapshot_blobs sb"
        " JOIN blobs b ON b.digest = sb.digest WHERE sb.snapshot_id = ?",
        [snapshot_id],
    )
    return {r["digest"]: r["size_bytes"] for r in rows}


def fingerprint_of(catalog: Catalog, fingerprint_digest: str) -> Fingerprint | None:
    """The full fingerprint a stored snapshot records for ``fingerprint_digest``."""
    found = catalog.rows(
        "SELECT fingerprint FROM snapshots WHERE fingerprint_digest = ? LIMIT 1",
        [fingerprint_digest],
    )
    return stored_fingerprint(found[0]["fingerprint"]) if found else None


def lru_unpinned(catalog: Catalog) -> list[str]:
    """Unpinned snapshot ids, least recently used first (never used: by creation)."""
    rows = catalog.rows(
        "SELECT id FROM snapshots WHERE pinned = 0"
        " ORDER BY COALESCE(last_used_at, created_at), created_at"
    )
    return [r["id"] for r in rows]


def counts(catalog: Catalog) -> Counts:
    row = catalog.rows(
        "SELECT (SELECT COUNT(*) FROM snapshots) AS snapshots,"
        " (SELECT COUNT(*) FROM blobs) AS blobs,"
        " (SELECT COALESCE(SUM(stored_bytes), 0) FROM blobs) AS stored_bytes"
    )[0]
    return Counts(int(row["snapshots"]), int(row["blobs"]), int(row["stored_bytes"]))
