"""Blobs and snapshots behind one object the routes use: ``Storage``.

The blob bytes live in a ``cachekeeper.blobstore.BlobStore`` (``LocalBlobStore`` under
``<data>/blobs`` by default; an S3-compatible backend only needs to implement that
protocol), their metadata in the ``Catalog``. This module adds what the server needs on
top: the upload size limit, publishing a manifest, and GC as plan -> execute (which evicts
LRU snapshots down to the hard cap; uploads never evict, see ``limits.StoreRoom``).

Ordering rules that keep a crash harmless: a blob's row is written only after the blob
store made the file visible (a crash before leaves at most a temp file, or a file with no
row that GC removes); a snapshot row appears in one transaction after every blob it names
has a row; deletion removes rows (pointers) before files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from cachekeeper.blobstore import BlobStore, LocalBlobStore, PutResult
from cachekeeper.errors import (
    BlobMissing,
    InvalidManifest,
    PayloadTooLarge,
    ServerUnavailable,
)
from cachekeeper.manifest import Manifest

from .catalog import Catalog, utc_now
from .settings import Settings

__all__ = ["Storage", "GcPlan", "limit_size"]


def limit_size(chunks: Iterable[bytes], *, max_bytes: int, what: str) -> Iterator[bytes]:
    """Pass ``chunks`` through, raising PayloadTooLarge once more than ``max_bytes`` went by."""
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > max_bytes:
            raise PayloadTooLarge(f"{what} is over the server's limit of {max_bytes} bytes")
        yield chunk


@dataclass(frozen=True)
class GcPlan:
    """What a GC run deletes; ``Storage.execute_gc`` carries it out."""

    snapshots_evicted: tuple[str, ...]
    blobs: tuple[str, ...]
    bytes_freed: int
    orphan_files: tuple[str, ...] = field(default=())


class Storage:
    """The server's store: a blob backend plus the metadata catalog."""

    def __init__(self, *, settings: Settings, catalog: Catalog, blobs: BlobStore) -> None:
        self.settings = settings
        self.catalog = catalog
        self.blobs = blobs
        self.evictions = 0  # snapshots evicted by GC since start (for /metrics)

    @classmethod
    def open(cls, settings: Settings) -> Storage:
        """The embedded default: SQLite at ``<data>/meta.sqlite``, blobs at ``<data>/blobs``."""
        data = settings.data_dir
        data.mkdir(parents=True, exist_ok=True)
        catalog = Catalog.create(data / "meta.sqlite")
        blobs = LocalBlobStore(data / "blobs")
        blobs.sweep_temp(older_than_s=0)  # nothing is uploading before we start
        return cls(settings=settings, catalog=catalog, blobs=blobs)

    # -- blobs ------------------------------------------------------------------------
    def put_blob(self, digest: str, chunks: Iterable[bytes]) -> PutResult:
        """Store the uncompressed ``chunks`` as blob ``digest`` (hash-checked), then its row."""
        limited = limit_size(chunks, max_bytes=self.settings.max_blob_bytes, what="blob")
        result = self.blobs.put(limited, digest=digest)
        stored = self.blobs.size(digest)
        if stored is None:  # deleted by a concurrent GC between put and here
            raise ServerUnavailable(f"blob {digest} was collected while uploading; retry")
        size = result.size_bytes
        if not result.created:
            row = self.catalog.blob_row(digest)
            size = row["size_bytes"] if row else _uncompressed_size(self.blobs, digest)
        self.catalog.record_blob(digest=digest, size_bytes=size, stored_bytes=stored)
        return PutResult(digest, size, stored, result.created)

    # -- snapshots --------------------------------------------------------------------
    def publish(self, manifest: Manifest) -> tuple[dict[str, Any], bool]:
        """Record ``manifest`` as a snapshot; (SUMMARY, created). Idempotent by id."""
        snapshot_id = manifest.id
        existing = self.catalog.summary(snapshot_id)
        if existing is not None:
            if manifest.signature is not None and not existing.get("signed"):
                # The same snapshot, now signed: keep the signature (the id is unchanged).
                with self.catalog.writing() as db:
                    db.execute(
                        "UPDATE snapshots SET manifest = ?, signed = 1 WHERE id = ? AND signed = 0",
                        [manifest.to_json(), snapshot_id],
                    )
                existing = self.catalog.summary(snapshot_id) or existing
            return existing, False
        sizes = self.catalog.blob_sizes(manifest.digests)
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
        now = utc_now()
        row = {
            "id": snapshot_id,
            "workload": manifest.workload,
            "fingerprint_digest": manifest.fingerprint_digest,
            "fingerprint": json.dumps(manifest.fingerprint, sort_keys=True),
            "devices": json.dumps(list(manifest.devices)),
            "verified": int(manifest.verified),
            "signed": int(manifest.signature is not None),
            "stats": json.dumps(manifest.stats, sort_keys=True),
            "size_bytes": manifest.size_bytes,
            "file_count": len(manifest.files),
            "created_at": now,
            "last_used_at": None,
            "pinned": 0,
            "manifest": manifest.to_json(),
            "source": manifest.source,
            "parent": manifest.parent,
        }
        with self.catalog.writing() as db:
            if db.execute("SELECT 1 FROM snapshots WHERE id = ?", [snapshot_id]).fetchone():
                created = False
            else:
                # A GC may have run since the check above: re-check inside the transaction.
                still = self.catalog_missing(db, manifest.digests)
                if still:
                    raise BlobMissing(
                        f"{len(still)} blob(s) of snapshot {snapshot_id[:12]} were collected",
                        extra={"missing": still},
                    )
                db.table("snapshots").insert(row)
                db.table("snapshot_blobs").insert_all(
                    ({"snapshot_id": snapshot_id, "digest": d} for d in sorted(manifest.digests)),
                    batch_size=500,
                )
                db.execute(
                    "UPDATE blobs SET last_access_at = ? WHERE digest IN"
                    " (SELECT digest FROM snapshot_blobs WHERE snapshot_id = ?)",
                    [now, snapshot_id],
                )
                self.catalog.add_event(
                    db, kind="snapshot.published", subject=snapshot_id, detail=manifest.workload
                )
                created = True
        summary = self.catalog.summary(snapshot_id)
        assert summary is not None
        return summary, created

    @staticmethod
    def catalog_missing(db: Any, digests: Iterable[str]) -> list[str]:
        wanted = sorted(set(digests))
        present: set[str] = set()
        for start in range(0, len(wanted), 500):
            part = wanted[start : start + 500]
            marks = ",".join("?" * len(part))
            present.update(
                r[0]
                for r in db.execute(f"SELECT digest FROM blobs WHERE digest IN ({marks})", part)
            )
        return [d for d in wanted if d not in present]

    # -- GC ---------------------------------------------------------------------------
    def plan_gc(self, *, target_bytes: int | None = None) -> GcPlan:
        """LRU-evict unpinned snapshots until stored bytes <= target, then list dead blobs.

        ``target_bytes`` defaults to ``max_store_bytes`` (no eviction when unlimited). A
        blob is deleted only when no kept snapshot references it, and either an evicted
        snapshot did or it was last touched more than ``gc_grace_s`` ago (so an upload
        waiting for its publish survives).
        """
        target = self.settings.max_store_bytes if target_bytes is None else target_bytes
        rows = self.catalog.rows(
            "SELECT b.digest AS digest, b.stored_bytes AS stored, b.last_access_at AS at,"
            " COUNT(sb.snapshot_id) AS refs FROM blobs b"
            " LEFT JOIN snapshot_blobs sb ON sb.digest = b.digest GROUP BY b.digest"
        )
        refs = {r["digest"]: r["refs"] for r in rows}
        stored = {r["digest"]: r["stored"] for r in rows}
        cutoff = (datetime.now(UTC) - timedelta(seconds=self.settings.gc_grace_s)).isoformat(
            timespec="microseconds"
        )
        old = {r["digest"] for r in rows if (r["at"] or "") < cutoff}
        dead = {d for d, n in refs.items() if n == 0 and d in old}
        total = sum(stored.values())
        freed = sum(stored[d] for d in dead)
        evicted: list[str] = []
        if target is not None and total - freed > target:
            lru = self.catalog.rows(
                "SELECT id FROM snapshots WHERE pinned = 0"
                " ORDER BY COALESCE(last_used_at, created_at), created_at"
            )
            for snap in lru:
                if total - freed <= target:
                    break
                evicted.append(snap["id"])
                for digest in self.catalog.snapshot_blobs(snap["id"]):
                    refs[digest] -= 1
                    if refs[digest] == 0 and digest not in dead:
                        dead.add(digest)
                        freed += stored[digest]
        known = set(stored)
        orphans = tuple(
            d
            for d in self.blobs.digests()
            if d not in known and _older_than(self.blobs, d, self.settings.gc_grace_s)
        )
        freed += sum(self.blobs.size(d) or 0 for d in orphans)
        return GcPlan(tuple(evicted), tuple(sorted(dead)), freed, orphans)

    def execute_gc(self, plan: GcPlan) -> GcPlan:
        """Delete what ``plan`` lists; rows first, files second; re-checks references."""
        with self.catalog.writing() as db:
            for snapshot_id in plan.snapshots_evicted:
                db.execute("DELETE FROM snapshot_blobs WHERE snapshot_id = ?", [snapshot_id])
                db.execute("DELETE FROM snapshots WHERE id = ?", [snapshot_id])
                self.catalog.add_event(
                    db, kind="snapshot.evicted", subject=snapshot_id, detail=None
                )
            doomed = [
                d
                for d in plan.blobs
                if not db.execute(
                    "SELECT 1 FROM snapshot_blobs WHERE digest = ? LIMIT 1", [d]
                ).fetchone()
            ]
            for start in range(0, len(doomed), 500):
                part = doomed[start : start + 500]
                db.execute(f"DELETE FROM blobs WHERE digest IN ({','.join('?' * len(part))})", part)
            # Files go while the lock is held, so an upload cannot re-add a row meanwhile.
            for digest in [*doomed, *plan.orphan_files]:
                self.blobs.delete(digest)
        self.evictions += len(plan.snapshots_evicted)
        return plan


def _older_than(blobs: BlobStore, digest: str, seconds: float) -> bool:
    path_for = getattr(blobs, "path_for", None)
    if path_for is None:
        return True
    try:
        return path_for(digest).stat().st_mtime < time.time() - seconds
    except FileNotFoundError:
        return False


def _uncompressed_size(blobs: BlobStore, digest: str) -> int:
    total = 0
    with blobs.open(digest) as fh:
        while chunk := fh.read(1 << 20):
            total += len(chunk)
    return total
