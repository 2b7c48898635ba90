"""``Catalog`` (connections, transactions) and the snapshot, blob, workload and start-up
check queries. Part of the catalog layer; callers import ``server.catalog`` (the package),
whose docstring draws the layer.

Every query the server makes is a method of ``Catalog`` (reads) or ``Transaction``
(inside a write); callers get frozen dataclasses, never row dicts. Each thread gets its
own connection (``check_same_thread=False``, opened lazily); WAL is enabled once by
``Catalog.create``. Every write goes through ``Catalog.writing()``: one real transaction
(``BEGIN IMMEDIATE`` ... ``COMMIT``, ``ROLLBACK`` on any exception) under ``write_lock``,
so writes are serialized in-process, never wait on SQLite's busy timeout, and a
multi-statement operation (publish, delete, pin, GC) is all or nothing.

Adding a table: a step appended to ``server/catalog/schema.py``'s list (the catalog's
schema version counts them), and its queries as methods here (or in ``server/catalog/fleet.py`` for the fleet), returning dataclasses.

A corrupt catalog is never served as if it were whole. ``Catalog.create`` runs SQLite's
``quick_check`` (every page of every table and index is read and its structure checked;
``integrity_check`` also cross-checks each index against its table, about five times
slower: ``check``) and refuses with ``CatalogCorrupt``, in one line naming the file and the
way back. A page that goes bad while the server runs is met by the first query that reads
it: that query, and every later one, answers 503 ``catalog_corrupt`` (``broken`` is sticky:
SQLite only reports a bad page when it reads it, so "it answered this time" proves nothing
about the next), and ``probe`` (``/healthz``) reads the first and last row of every table,
so a server whose catalog cannot answer stops passing its health check.
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import sqlite_utils
from cachekeeper.server.records import BlobInfo, BlobUsage, Candidate, Counts

from cachekeeper.errors import CatalogCorrupt, InsufficientStorage
from cachekeeper.fingerprint import Fingerprint
from cachekeeper.manifest import Manifest, built_by
from cachekeeper.wire import Summary, WorkloadInfo, utc_now

from .base import BATCH, chunks
from .budget import BudgetWrites
from .fleet import FleetReads, FleetWrites, agent_id_for
from .schema import check_version, ensure_schema
from .tier import TierReads, TierWrites

__all__ = ["Catalog", "Transaction", "agent_id_for", "is_corruption"]

_SUMMARY_COLUMNS = (
    "id, workload, fingerprint_digest, devices, verified, signed, size_bytes, file_count, "
    "created_at, last_used_at, pinned, source, parent"
)


def _stored(text: str) -> Fingerprint:
    """A snapshot row's fingerprint: checked (``fingerprint.parse``) when its manifest was
    published; a server before the typed fingerprint checked only that it was an object,
    so readers of stored rows (resolve, the status page) read them with ``get``."""
    return cast(Fingerprint, json.loads(text))


def _summary(row: dict[str, Any]) -> Summary:
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


_log = logging.getLogger("cachekeeper.server")
PROBE_SAMPLES = 2  # random rows per table each /healthz reads, besides the first and last
_CORRUPT = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}
# What to do about a corrupt catalog: docs/operations.md, "A corrupt catalog".
_WAY_BACK = (
    "stop it, then restore the last backup, or rebuild the file from what SQLite can still"
    " read with the sqlite3 shell's .recover (docs/operations.md, 'A corrupt catalog',"
    " gives the commands)"
)


def is_corruption(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite saying the file is damaged (a malformed page, not a database)."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    return code in _CORRUPT or "malformed" in str(exc) or "not a database" in str(exc)


def _disk_full(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code == sqlite3.SQLITE_FULL or "database or disk is full" in str(exc)


class Transaction(FleetWrites, TierWrites, BudgetWrites):
    """The queries that run inside one ``Catalog.writing()`` block (reads see its writes)."""

    # -- blobs ------------------------------------------------------------------------
    def missing_blob_rows(self, digests: Iterable[str]) -> list[str]:
        """The ``digests`` that have no blob row, sorted."""
        wanted = sorted(set(digests))
        present: set[str] = set()
        for part, marks in chunks(wanted):
            sql = f"SELECT digest FROM blobs WHERE digest IN ({marks})"
            present.update(r[0] for r in self.db.execute(sql, part))
        return [d for d in wanted if d not in present]

    def record_blob(self, *, digest: str, size_bytes: int, stored_bytes: int) -> None:
        now = utc_now()
        self.db.execute(
            "INSERT INTO blobs (digest, size_bytes, stored_bytes, created_at, last_access_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT(digest) DO UPDATE SET"
            " last_access_at = excluded.last_access_at",
            [digest, size_bytes, stored_bytes, now, now],
        )

    def blob_last_access(self, digest: str) -> str | None:
        """The row's ``last_access_at`` ('' when never set), or None when there is no row."""
        found = self.db.execute("SELECT last_access_at FROM blobs WHERE digest = ?", [digest])
        row = found.fetchone()
        return None if row is None else (row[0] or "")

    def delete_unused_blob_rows(
        self, digests: Iterable[str], *, unused_since: str
    ) -> dict[str, int]:
        """Delete the rows of ``digests`` that nothing references and nobody used after
        ``unused_since``; {digest: stored bytes} of those deleted."""
        gone: dict[str, int] = {}
        for part, marks in chunks(sorted(set(digests))):
            rows = self.db.execute(
                f"SELECT digest, stored_bytes FROM blobs WHERE digest IN ({marks})"
                " AND COALESCE(last_access_at, '') <= ? AND NOT EXISTS"
                " (SELECT 1 FROM snapshot_blobs sb WHERE sb.digest = blobs.digest)",
                [*part, unused_since],
            )
            gone.update((r[0], int(r[1])) for r in rows)
        self.delete_blob_rows(gone)
        return gone

    def delete_blob_rows(self, digests: Iterable[str]) -> None:
        for part, marks in chunks(sorted(set(digests))):
            self.db.execute(f"DELETE FROM blobs WHERE digest IN ({marks})", part)

    # -- snapshots --------------------------------------------------------------------
    def snapshot_exists(self, snapshot_id: str) -> bool:
        return self._one("SELECT 1 FROM snapshots WHERE id = ?", [snapshot_id]) is not None

    def referenced_digests(self, snapshot_id: str) -> set[str]:
        sql = "SELECT digest FROM snapshot_blobs WHERE snapshot_id = ?"
        return {r[0] for r in self.db.execute(sql, [snapshot_id])}

    def insert_snapshot(self, manifest: Manifest, *, created_at: str) -> None:
        """The snapshot's row, its blob references, and a ``snapshot.published`` event."""
        self.db.table("snapshots").insert(
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
        self.add_references(manifest.id, manifest.digests, at=created_at)
        self.add_event(kind="snapshot.published", subject=manifest.id, detail=manifest.workload)

    def add_references(self, snapshot_id: str, digests: Iterable[str], *, at: str) -> None:
        """Reference ``digests`` from the snapshot (idempotent) and mark them used ``at``."""
        self.db.table("snapshot_blobs").insert_all(
            ({"snapshot_id": snapshot_id, "digest": d} for d in sorted(set(digests))),
            batch_size=BATCH,
            ignore=True,
        )
        self.db.execute(
            "UPDATE blobs SET last_access_at = ? WHERE digest IN"
            " (SELECT digest FROM snapshot_blobs WHERE snapshot_id = ?)",
            [at, snapshot_id],
        )

    def sign_snapshot(self, snapshot_id: str, *, manifest_json: str) -> None:
        """Store the signed manifest of an unsigned snapshot (the id does not change)."""
        self.db.execute(
            "UPDATE snapshots SET manifest = ?, signed = 1 WHERE id = ? AND signed = 0",
            [manifest_json, snapshot_id],
        )

    def touch_snapshot(self, snapshot_id: str) -> None:
        sql = "UPDATE snapshots SET last_used_at = ? WHERE id = ?"
        self.db.execute(sql, [utc_now(), snapshot_id])

    def set_pinned(self, snapshot_id: str, *, pinned: bool) -> bool:
        sql = "UPDATE snapshots SET pinned = ? WHERE id = ?"
        return self.db.execute(sql, [int(pinned), snapshot_id]).rowcount > 0

    def delete_snapshot(self, snapshot_id: str, *, only_unpinned: bool = False) -> bool:
        """Remove a snapshot's row and references (blobs stay for GC); False if not there
        (or pinned, with ``only_unpinned``)."""
        pinned_clause = " AND pinned = 0" if only_unpinned else ""
        sql = f"SELECT 1 FROM snapshots WHERE id = ?{pinned_clause}"
        if self._one(sql, [snapshot_id]) is None:
            return False
        self.db.execute("DELETE FROM snapshot_blobs WHERE snapshot_id = ?", [snapshot_id])
        self.db.execute("DELETE FROM archive_objects WHERE snapshot_id = ?", [snapshot_id])
        self.db.execute("DELETE FROM snapshots WHERE id = ?", [snapshot_id])
        return True

    def record_archive(self, snapshot_id: str, *, etag: str, size_bytes: int) -> None:
        """The object-store archive of ``snapshot_id`` as this server wrote it."""
        self.db.execute(
            "INSERT INTO archive_objects (snapshot_id, etag, size_bytes) VALUES (?, ?, ?)"
            " ON CONFLICT(snapshot_id) DO UPDATE SET etag = excluded.etag,"
            " size_bytes = excluded.size_bytes",
            [snapshot_id, etag, size_bytes],
        )

    def manifest_text(self, snapshot_id: str) -> str | None:
        found = self.db.execute("SELECT manifest FROM snapshots WHERE id = ?", [snapshot_id])
        row = found.fetchone()
        return None if row is None else str(row[0])

    # -- the start-up check -------------------------------------------------------------
    def blob_row_digests(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT digest FROM blobs")}

    def incomplete_suspects(self) -> list[str]:
        """Snapshots that may reference fewer blobs than their manifest names: fewer
        references than files (exact only after parsing: files may share a blob), or a
        reference to a blob with no row."""
        rows = self.db.execute(
            "SELECT s.id FROM snapshots s LEFT JOIN (SELECT snapshot_id, COUNT(*) AS n"
            " FROM snapshot_blobs GROUP BY snapshot_id) r ON r.snapshot_id = s.id"
            " WHERE COALESCE(r.n, 0) < s.file_count"
            " UNION SELECT sb.snapshot_id FROM snapshot_blobs sb"
            " LEFT JOIN blobs b ON b.digest = sb.digest WHERE b.digest IS NULL"
        )
        return sorted(r[0] for r in rows)

    def quarantine_snapshot(self, snapshot_id: str, *, reason: str) -> None:
        """Take a snapshot out of service, keeping its manifest in ``quarantine``."""
        manifest = self.manifest_text(snapshot_id) or ""
        self.db.execute(
            "INSERT INTO quarantine (id, at, reason, manifest) VALUES (?, ?, ?, ?)"
            " ON CONFLICT(id) DO UPDATE SET at = excluded.at, reason = excluded.reason,"
            " manifest = excluded.manifest",
            [snapshot_id, utc_now(), reason, manifest],
        )
        self.delete_snapshot(snapshot_id)
        self.add_event(kind="snapshot.quarantined", subject=snapshot_id, detail=reason)

    # -- workloads --------------------------------------------------------------------
    def put_workload(self, *, name: str, toml: str, digest: str) -> WorkloadInfo:
        """Register or replace; ``updated_at`` moves only when the text changes (an identical
        re-registration changes nothing)."""
        self.db.execute(
            "INSERT INTO workloads (name, toml, digest, updated_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT(name) DO UPDATE SET toml = excluded.toml,"
            " updated_at = CASE WHEN workloads.digest = excluded.digest"
            " THEN workloads.updated_at ELSE excluded.updated_at END,"
            " digest = excluded.digest",
            [name, toml, digest, utc_now()],
        )
        updated_at = self._one("SELECT updated_at FROM workloads WHERE name = ?", [name])
        return WorkloadInfo(name=name, digest=digest, updated_at=updated_at)

    def delete_workload(self, name: str) -> bool:
        return self.db.execute("DELETE FROM workloads WHERE name = ?", [name]).rowcount > 0

    # -- events -----------------------------------------------------------------------
    def add_event(self, *, kind: str, subject: str, detail: Any) -> None:
        self.db.execute(
            "INSERT INTO events (at, kind, subject, detail) VALUES (?, ?, ?, ?)",
            [utc_now(), kind, subject, json.dumps(detail, sort_keys=True)],
        )


class Catalog(FleetReads, TierReads):
    """Connections to the metadata database; reads here, writes in ``writing()``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.write_lock = threading.Lock()
        self._local = threading.local()
        # Why the catalog cannot answer, once a query met a damaged page (sticky).
        self.broken: str | None = None

    @classmethod
    def create(cls, path: Path, *, check: str = "quick") -> Catalog:
        """Open (creating if needed) the database at ``path``, check it (``check``:
        ``quick``, ``full`` or ``off``), enable WAL, run the schema steps past its version
        (``schema.py``). CatalogCorrupt, naming the file and the way back, when SQLite finds
        it damaged; CatalogTooNew, writing nothing, when a newer cachekeeper wrote it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        catalog = cls(path)
        try:
            if check != "off":
                catalog._check(full=check == "full")
            check_version(catalog.db(), name=str(path))  # a newer one's: refused, unwritten
            catalog.db().enable_wal()
            with catalog.writing() as tx:
                found, now = ensure_schema(tx.db, name=str(path))
                tx.recount_usage()  # after a restore or a .recover, the triggers' totals
            if found != now:
                new = " (new, or written before versions)" if found == 0 else ""
                _log.info("catalog %s: schema version %d -> %d%s", path, found, now, new)
        except CatalogCorrupt:
            raise
        except sqlite3.DatabaseError as exc:
            if not is_corruption(exc):
                raise
            raise CatalogCorrupt(catalog._refusal(str(exc))) from exc
        return catalog

    def _check(self, *, full: bool) -> None:
        pragma = "integrity_check" if full else "quick_check"
        try:
            found = [str(r[0]) for r in self.db().conn.execute(f"PRAGMA {pragma}(5)")]
        except sqlite3.DatabaseError as exc:  # a page it cannot even walk
            if not is_corruption(exc):
                raise
            found = [str(exc)]
        if found != ["ok"]:
            raise CatalogCorrupt(self._refusal(f"PRAGMA {pragma}: {'; '.join(found)}"))

    def _refusal(self, problem: str) -> str:
        problem = " ".join(problem.split())[:300]
        return (
            f"catalog {self.path} is corrupt ({problem}); the server will not serve it: "
            + _WAY_BACK
        )

    # -- when the catalog cannot answer ------------------------------------------------------
    def met(self, exc: sqlite3.DatabaseError) -> CatalogCorrupt:
        """Mark the catalog broken by ``exc`` (a corruption) and say so to the caller."""
        if self.broken is None:
            self.broken = (
                f"the server's catalog ({self.path.name}) is corrupt: {exc}; the operator"
                " must restore it (docs/operations.md, 'A corrupt catalog')"
            )
            _log.error("%s", self._refusal(f"{exc}, met by a query while serving"))
        return CatalogCorrupt(self.broken)

    def _rows(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        if self.broken is not None:
            raise CatalogCorrupt(self.broken)
        try:
            return super()._rows(sql, params)
        except sqlite3.DatabaseError as exc:
            if is_corruption(exc):
                raise self.met(exc) from exc
            raise

    def probe(self, *, samples: int = PROBE_SAMPLES) -> str | None:
        """Why the catalog cannot answer now, or None.

        Every table's first and last row are read, and ``samples`` rows at random rowids
        between them: each a root-to-leaf walk, a few pages however big the table (well
        under a millisecond for the whole catalog: docs/operations.md). A damaged page
        among thousands is found by the first query that reads it, which marks the catalog
        broken for every later probe; the random rows make the probes themselves find one
        sooner or later, at no more cost per probe.
        """
        if self.broken is not None:
            return self.broken
        conn = self.db().conn
        try:
            tables = [
                str(r[0])
                for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'"
                    " AND name NOT LIKE 'sqlite_%'"
                )
            ]
            for table in tables:
                ends = [
                    conn.execute(
                        f'SELECT rowid, * FROM "{table}" ORDER BY rowid{order} LIMIT 1'
                    ).fetchone()
                    for order in ("", " DESC")
                ]
                if ends[0] is None or ends[1] is None:
                    continue
                for _ in range(samples):
                    at = random.randint(int(ends[0][0]), int(ends[1][0]))
                    sql = f'SELECT * FROM "{table}" WHERE rowid >= ? ORDER BY rowid LIMIT 1'
                    conn.execute(sql, [at]).fetchall()
        except sqlite3.DatabaseError as exc:
            if is_corruption(exc):
                return self.met(exc).detail
            return f"the server's catalog ({self.path.name}) cannot answer: {exc}"
        return None

    def db(self) -> sqlite_utils.Database:
        """This thread's connection (opened on first use).

        ``isolation_level=None``: Python's sqlite3 module opens no transaction on its own,
        so the only transactions are the ``BEGIN IMMEDIATE`` of ``writing()``. Inside one,
        sqlite-utils' ``execute`` and ``insert``/``insert_all`` commit nothing themselves
        (they see ``conn.in_transaction`` and use a savepoint); outside, each statement
        commits alone.
        """
        db = getattr(self._local, "db", None)
        if db is None:
            conn = sqlite3.connect(
                self.path, check_same_thread=False, timeout=30.0, isolation_level=None
            )
            conn.execute("PRAGMA synchronous=NORMAL")
            db = sqlite_utils.Database(conn)
            self._local.db = db
        return db

    @contextmanager
    def writing(self) -> Iterator[Transaction]:
        """One write transaction: everything in the block commits together or not at all.

        Holds ``write_lock`` (one writer at a time in this process) and SQLite's write
        lock (``BEGIN IMMEDIATE``) for the block; any exception rolls back the whole block.
        A full disk (SQLITE_FULL) is raised as InsufficientStorage (507), after rollback.
        """
        if self.broken is not None:
            raise CatalogCorrupt(self.broken)
        conn = self.db().conn
        with self.write_lock:
            try:
                conn.execute("BEGIN IMMEDIATE")
                tx = Transaction(self.db())
                try:
                    yield tx
                    conn.execute("COMMIT")
                finally:
                    if conn.in_transaction:  # an exception in the block, or in COMMIT
                        conn.execute("ROLLBACK")
            except sqlite3.DatabaseError as exc:
                if isinstance(exc, sqlite3.OperationalError) and _disk_full(exc):
                    raise InsufficientStorage(
                        f"the server's metadata disk is full ({exc}); nothing was changed"
                    ) from exc
                if is_corruption(exc):
                    raise self.met(exc) from exc
                raise
            for action in tx.after_commit_actions:
                action()

    # -- blobs ------------------------------------------------------------------------
    def blob_info(self, digest: str) -> BlobInfo | None:
        found = self._rows("SELECT * FROM blobs WHERE digest = ?", [digest])
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

    def blob_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        """{digest: uncompressed size} for the digests that have a row."""
        out: dict[str, int] = {}
        for part, marks in chunks(list(dict.fromkeys(digests))):
            sql = f"SELECT digest, size_bytes FROM blobs WHERE digest IN ({marks})"
            out.update((r["digest"], r["size_bytes"]) for r in self._rows(sql, part))
        return out

    def blob_usage(self) -> list[BlobUsage]:
        """Every blob row with its stored size, last use and reference count."""
        rows = self._rows(
            "SELECT b.digest AS digest, b.stored_bytes AS stored, b.last_access_at AS at,"
            " COUNT(sb.snapshot_id) AS refs FROM blobs b"
            " LEFT JOIN snapshot_blobs sb ON sb.digest = b.digest GROUP BY b.digest"
        )
        return [
            BlobUsage(r["digest"], int(r["stored"]), r["at"] or "", int(r["refs"])) for r in rows
        ]

    def store_bytes(self) -> int:
        row = self._rows("SELECT COALESCE(SUM(stored_bytes), 0) AS n FROM blobs")[0]
        return int(row["n"])

    def catalog_bytes(self) -> int:
        """The database's size in bytes less its free pages (WAL content included)."""
        row = self._rows(
            "SELECT (SELECT page_size FROM pragma_page_size()) * ((SELECT page_count FROM"
            " pragma_page_count()) - (SELECT freelist_count FROM pragma_freelist_count())) AS n"
        )[0]
        return int(row["n"])

    def counts(self) -> Counts:
        row = self._rows(
            "SELECT (SELECT COUNT(*) FROM snapshots) AS snapshots,"
            " (SELECT COUNT(*) FROM blobs) AS blobs,"
            " (SELECT COALESCE(SUM(stored_bytes), 0) FROM blobs) AS stored_bytes"
        )[0]
        return Counts(int(row["snapshots"]), int(row["blobs"]), int(row["stored_bytes"]))

    # -- snapshots --------------------------------------------------------------------
    def summary(self, snapshot_id: str) -> Summary | None:
        sql = f"SELECT {_SUMMARY_COLUMNS} FROM snapshots WHERE id = ?"
        found = self._rows(sql, [snapshot_id])
        return _summary(found[0]) if found else None

    def manifest_text(self, snapshot_id: str) -> str | None:
        found = self._rows("SELECT manifest FROM snapshots WHERE id = ?", [snapshot_id])
        return str(found[0]["manifest"]) if found else None

    def list_summaries(
        self,
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
            f"SELECT {_SUMMARY_COLUMNS} FROM snapshots {clause} ORDER BY rowid DESC LIMIT ?"
        )
        return [_summary(r) for r in self._rows(sql, [*params, limit])]

    def candidates(self, workload: str | None, *, limit: int = 2000) -> list[Candidate]:
        """Snapshots of a workload with what resolve compares, newest published first."""
        sql = (
            f"SELECT {_SUMMARY_COLUMNS}, fingerprint, rowid AS seq, stats FROM snapshots"
            " WHERE workload IS ? AND source IS NULL ORDER BY rowid DESC LIMIT ?"
        )
        parsed: dict[str, Fingerprint] = {}  # one parse per distinct fingerprint
        out = []
        for row in self._rows(sql, [workload, limit]):
            fingerprint = parsed.get(row["fingerprint_digest"])
            if fingerprint is None:
                fingerprint = parsed[row["fingerprint_digest"]] = _stored(row["fingerprint"])
            out.append(
                Candidate(
                    summary=_summary(row),
                    fingerprint=fingerprint,
                    seq=row["seq"],
                    built_by=built_by(json.loads(row["stats"] or "null")),
                )
            )
        return out

    def archive_etag(self, snapshot_id: str) -> str | None:
        """The ETag of the archive object this server wrote for ``snapshot_id``, if any."""
        found = self._rows("SELECT etag FROM archive_objects WHERE snapshot_id = ?", [snapshot_id])
        return str(found[0]["etag"]) if found else None

    def snapshot_blobs(self, snapshot_id: str) -> dict[str, int]:
        """{digest: uncompressed size} of a snapshot's distinct blobs."""
        rows = self._rows(
            "SELECT sb.digest AS digest, b.size_bytes AS size_bytes FROM snapshot_blobs sb"
            " JOIN blobs b ON b.digest = sb.digest WHERE sb.snapshot_id = ?",
            [snapshot_id],
        )
        return {r["digest"]: r["size_bytes"] for r in rows}

    def harvested_deltas(
        self, parent_id: str, *, fingerprint_digest: str, limit: int = 32
    ) -> list[Summary]:
        """Summaries of the harvested deltas of ``parent_id`` for one environment, oldest first."""
        rows = self._rows(
            f"SELECT {_SUMMARY_COLUMNS} FROM snapshots WHERE parent = ? AND source = 'harvest'"
            " AND fingerprint_digest = ? ORDER BY rowid LIMIT ?",
            [parent_id, fingerprint_digest, limit],
        )
        return [_summary(r) for r in rows]

    def fingerprint_of(self, fingerprint_digest: str) -> Fingerprint | None:
        """The full fingerprint a stored snapshot records for ``fingerprint_digest``."""
        found = self._rows(
            "SELECT fingerprint FROM snapshots WHERE fingerprint_digest = ? LIMIT 1",
            [fingerprint_digest],
        )
        return _stored(found[0]["fingerprint"]) if found else None

    def lru_unpinned(self) -> list[str]:
        """Unpinned snapshot ids, least recently used first (never used: by creation)."""
        rows = self._rows(
            "SELECT id FROM snapshots WHERE pinned = 0"
            " ORDER BY COALESCE(last_used_at, created_at), created_at"
        )
        return [r["id"] for r in rows]

    # -- workloads --------------------------------------------------------------------
    def workload_toml(self, name: str) -> str | None:
        found = self._rows("SELECT toml FROM workloads WHERE name = ?", [name])
        return str(found[0]["toml"]) if found else None

    def list_workloads(self) -> list[WorkloadInfo]:
        rows = self._rows("SELECT name, digest, updated_at FROM workloads ORDER BY name")
        return [
            WorkloadInfo(name=r["name"], digest=r["digest"], updated_at=r["updated_at"])
            for r in rows
        ]
