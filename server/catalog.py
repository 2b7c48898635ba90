"""The server's metadata: one SQLite file (WAL mode) through sqlite-utils.

Tables::

    snapshots       id (manifest sha256), workload, fingerprint_digest, fingerprint (JSON),
                    devices (JSON), verified, signed, stats (JSON), size_bytes, file_count,
                    created_at, last_used_at, pinned, manifest (JSON text, signature included),
                    source ("harvest" or NULL), parent (a harvested delta's parent id)
    blobs           digest, size_bytes (uncompressed), stored_bytes (zstd at rest),
                    created_at, last_access_at
    snapshot_blobs  (snapshot_id, digest): which blobs each snapshot references
    workloads       name, toml, digest (sha256 of the TOML text), updated_at
    agents          id, name, fingerprint_digest, fingerprint (JSON), devices (JSON),
                    registered_at, last_seen_at, info (JSON: gpus, version)
    events          an audit log (snapshot.published, ...)
    agent_events    what agents report per (workload, fingerprint_digest): building, built,
                    skipped, cold_compile_broken, failed (see routes_agents)
    job_reports     what training jobs report (POST /v1/reports): phase (prejob, postjob),
                    outcome, workload, fingerprint_digest, snapshot_id, node, devices
                    (JSON), reason_code, reason, new_fxgraph, new_aotautograd, new_triton,
                    new_other, new_bytes, started_at, finished_at, at (received)

Each thread gets its own connection (``check_same_thread=False``, opened lazily); WAL is
enabled once by ``Catalog.create``. Writes take ``Catalog.write_lock`` and stay short, so
they are serialized in-process and never wait on SQLite's busy timeout.

Adding a table for a new router: add its ``create`` call to ``_SCHEMA_STEPS`` (idempotent,
``if_not_exists=True``) and its queries to the router module, using ``catalog.db()`` for
reads and ``with catalog.writing() as db:`` for writes.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlite_utils

from cachekeeper.wire import JobReport, JobStats

__all__ = ["Catalog", "utc_now", "summary_of"]

_BATCH = 500


def utc_now() -> str:
    """The current UTC time as ISO 8601 with microseconds (sorts as text)."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _create_snapshots(db: sqlite_utils.Database) -> None:
    db.table("snapshots").create(
        {
            "id": str,
            "workload": str,
            "fingerprint_digest": str,
            "fingerprint": str,
            "devices": str,
            "verified": int,
            "signed": int,
            "stats": str,
            "size_bytes": int,
            "file_count": int,
            "created_at": str,
            "last_used_at": str,
            "pinned": int,
            "manifest": str,
        },
        pk="id",
        not_null=["fingerprint_digest", "fingerprint", "created_at", "manifest"],
        if_not_exists=True,
    )
    db.table("snapshots").create_index(["workload", "created_at"], if_not_exists=True)
    db.table("snapshots").create_index(["fingerprint_digest"], if_not_exists=True)
    db.table("snapshots").create_index(["last_used_at"], if_not_exists=True)


def _create_blobs(db: sqlite_utils.Database) -> None:
    db.table("blobs").create(
        {
            "digest": str,
            "size_bytes": int,
            "stored_bytes": int,
            "created_at": str,
            "last_access_at": str,
        },
        pk="digest",
        if_not_exists=True,
    )
    db.table("snapshot_blobs").create(
        {"snapshot_id": str, "digest": str}, pk=("snapshot_id", "digest"), if_not_exists=True
    )
    db.table("snapshot_blobs").create_index(["digest"], if_not_exists=True)


def _create_workloads(db: sqlite_utils.Database) -> None:
    db.table("workloads").create(
        {"name": str, "toml": str, "digest": str, "updated_at": str},
        pk="name",
        if_not_exists=True,
    )


def _create_agents_events(db: sqlite_utils.Database) -> None:
    db.table("agents").create(
        {
            "id": str,
            "name": str,
            "fingerprint_digest": str,
            "fingerprint": str,
            "devices": str,
            "registered_at": str,
            "last_seen_at": str,
            "info": str,
        },
        pk="id",
        if_not_exists=True,
    )
    db.table("events").create(
        {"id": int, "at": str, "kind": str, "subject": str, "detail": str},
        pk="id",
        if_not_exists=True,
    )
    db.table("events").create_index(["at"], if_not_exists=True)


def _create_agent_events(db: sqlite_utils.Database) -> None:
    db.table("agent_events").create(
        {
            "id": int,
            "at": str,
            "agent_id": str,
            "workload": str,
            "fingerprint_digest": str,
            "status": str,
            "detail": str,
            "traceback_tail": str,
            "snapshot_id": str,
            "seconds": float,
        },
        pk="id",
        not_null=["at", "agent_id", "workload", "fingerprint_digest", "status"],
        if_not_exists=True,
    )
    db.table("agent_events").create_index(
        ["workload", "fingerprint_digest", "id"], if_not_exists=True
    )


def _add_harvest_columns(db: sqlite_utils.Database) -> None:
    """``source`` and ``parent`` (harvested deltas), added to older databases in place."""
    table = db.table("snapshots")
    for name in ("source", "parent"):
        if name not in table.columns_dict:
            table.add_column(name, str)
    table.create_index(["parent"], if_not_exists=True)


def _create_job_reports(db: sqlite_utils.Database) -> None:
    db.table("job_reports").create(
        {
            "id": int,
            "at": str,
            "phase": str,
            "outcome": str,
            "workload": str,
            "fingerprint_digest": str,
            "snapshot_id": str,
            "node": str,
            "devices": str,
            "reason_code": str,
            "reason": str,
            "new_fxgraph": int,
            "new_aotautograd": int,
            "new_triton": int,
            "new_other": int,
            "new_bytes": int,
            "started_at": str,
            "finished_at": str,
        },
        pk="id",
        not_null=["at", "phase", "outcome", "workload", "fingerprint_digest"],
        if_not_exists=True,
    )
    db.table("job_reports").create_index(["workload", "fingerprint_digest"], if_not_exists=True)


_SCHEMA_STEPS: list[Callable[[sqlite_utils.Database], None]] = [
    _create_snapshots,
    _create_blobs,
    _create_workloads,
    _create_agents_events,
    _create_agent_events,
    _create_job_reports,
    _add_harvest_columns,
]


def summary_of(row: dict[str, Any]) -> dict[str, Any]:
    """The API's SUMMARY of a snapshot row."""
    return {
        "id": row["id"],
        "workload": row["workload"],
        "fingerprint_digest": row["fingerprint_digest"],
        "devices": json.loads(row["devices"] or "[]"),
        "verified": bool(row["verified"]),
        "signed": bool(row["signed"]),
        "size_bytes": row["size_bytes"],
        "file_count": row["file_count"],
        "created_at": row["created_at"],
        "last_used_at": row["last_used_at"],
        "pinned": bool(row["pinned"]),
    }


_SUMMARY_COLUMNS = (
    "id, workload, fingerprint_digest, devices, verified, signed, size_bytes, file_count, "
    "created_at, last_used_at, pinned"
)


class Catalog:
    """Connections to the metadata database and the queries the routes share."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.write_lock = threading.Lock()
        self._local = threading.local()

    @classmethod
    def create(cls, path: Path) -> Catalog:
        """Open (creating if needed) the database at ``path``, enable WAL, ensure tables."""
        path.parent.mkdir(parents=True, exist_ok=True)
        catalog = cls(path)
        db = catalog.db()
        db.enable_wal()
        with catalog.writing() as wdb:
            for step in _SCHEMA_STEPS:
                step(wdb)
        return catalog

    def db(self) -> sqlite_utils.Database:
        """This thread's connection (opened on first use)."""
        db = getattr(self._local, "db", None)
        if db is None:
            conn = sqlite3.connect(self.path, check_same_thread=False, timeout=30.0)
            conn.execute("PRAGMA synchronous=NORMAL")
            db = sqlite_utils.Database(conn)
            self._local.db = db
        return db

    @contextmanager
    def writing(self) -> Iterator[sqlite_utils.Database]:
        """A short serialized write transaction on this thread's connection."""
        db = self.db()
        with self.write_lock, db.conn:
            yield db

    def rows(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        return list(self.db().query(sql, list(params)))

    # -- blobs ------------------------------------------------------------------------
    def record_blob(self, *, digest: str, size_bytes: int, stored_bytes: int) -> None:
        now = utc_now()
        with self.writing() as db:
            db.execute(
                "INSERT INTO blobs (digest, size_bytes, stored_bytes, created_at, last_access_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT(digest) DO UPDATE SET"
                " last_access_at = excluded.last_access_at",
                [digest, size_bytes, stored_bytes, now, now],
            )

    def blob_row(self, digest: str) -> dict[str, Any] | None:
        found = self.rows("SELECT * FROM blobs WHERE digest = ?", [digest])
        return found[0] if found else None

    def blob_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        """{digest: uncompressed size} for the digests that are stored."""
        wanted = list(dict.fromkeys(digests))
        out: dict[str, int] = {}
        for start in range(0, len(wanted), _BATCH):
            part = wanted[start : start + _BATCH]
            marks = ",".join("?" * len(part))
            for row in self.rows(
                f"SELECT digest, size_bytes FROM blobs WHERE digest IN ({marks})", part
            ):
                out[row["digest"]] = row["size_bytes"]
        return out

    def missing_blobs(self, digests: Iterable[str]) -> list[str]:
        wanted = list(dict.fromkeys(digests))
        present = self.blob_sizes(wanted)
        return [d for d in wanted if d not in present]

    def store_bytes(self) -> int:
        row = self.rows("SELECT COALESCE(SUM(stored_bytes), 0) AS n FROM blobs")[0]
        return int(row["n"])

    def counts(self) -> dict[str, int]:
        row = self.rows(
            "SELECT (SELECT COUNT(*) FROM snapshots) AS snapshots,"
            " (SELECT COUNT(*) FROM blobs) AS blobs,"
            " (SELECT COALESCE(SUM(stored_bytes), 0) FROM blobs) AS stored_bytes"
        )[0]
        return {k: int(v) for k, v in row.items()}

    # -- snapshots --------------------------------------------------------------------
    def snapshot_row(self, snapshot_id: str, *, columns: str = "*") -> dict[str, Any] | None:
        found = self.rows(f"SELECT {columns} FROM snapshots WHERE id = ?", [snapshot_id])
        return found[0] if found else None

    def summary(self, snapshot_id: str) -> dict[str, Any] | None:
        row = self.snapshot_row(snapshot_id, columns=_SUMMARY_COLUMNS)
        return summary_of(row) if row else None

    def list_summaries(
        self,
        *,
        workload: str | None = None,
        fingerprint_digest: str | None = None,
        verified: bool | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        where: list[str] = []
        params: list[Any] = []
        if workload is not None:
            where.append("workload = ?")
            params.append(workload)
        if fingerprint_digest is not None:
            where.append("fingerprint_digest = ?")
            params.append(fingerprint_digest)
        if verified is not None:
            where.append("verified = ?")
            params.append(int(verified))
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        sql = (
            f"SELECT {_SUMMARY_COLUMNS} FROM snapshots {clause}"
            " ORDER BY created_at DESC, id LIMIT ?"
        )
        return [summary_of(r) for r in self.rows(sql, [*params, limit])]

    def candidates(self, workload: str | None, *, limit: int = 2000) -> list[dict[str, Any]]:
        """Snapshots of a workload with what resolve compares, newest first."""
        sql = (
            f"SELECT {_SUMMARY_COLUMNS}, fingerprint FROM snapshots WHERE workload IS ?"
            " AND source IS NULL ORDER BY created_at DESC, id LIMIT ?"
        )
        return self.rows(sql, [workload, limit])

    def touch_snapshot(self, snapshot_id: str) -> None:
        with self.writing() as db:
            db.execute(
                "UPDATE snapshots SET last_used_at = ? WHERE id = ?", [utc_now(), snapshot_id]
            )

    def set_pinned(self, snapshot_id: str, *, pinned: bool) -> bool:
        with self.writing() as db:
            cursor = db.execute(
                "UPDATE snapshots SET pinned = ? WHERE id = ?", [int(pinned), snapshot_id]
            )
            return cursor.rowcount > 0

    def delete_snapshot(self, snapshot_id: str) -> bool:
        """Remove a snapshot's rows (pointers first); its blobs are left for GC."""
        with self.writing() as db:
            db.execute("DELETE FROM snapshot_blobs WHERE snapshot_id = ?", [snapshot_id])
            cursor = db.execute("DELETE FROM snapshots WHERE id = ?", [snapshot_id])
            return cursor.rowcount > 0

    def snapshot_blobs(self, snapshot_id: str) -> dict[str, int]:
        """{digest: uncompressed size} of a snapshot's distinct blobs."""
        rows = self.rows(
            "SELECT sb.digest AS digest, b.size_bytes AS size_bytes FROM snapshot_blobs sb"
            " JOIN blobs b ON b.digest = sb.digest WHERE sb.snapshot_id = ?",
            [snapshot_id],
        )
        return {r["digest"]: r["size_bytes"] for r in rows}

    def harvested_deltas(
        self, parent_id: str, *, fingerprint_digest: str, limit: int = 32
    ) -> list[dict[str, Any]]:
        """SUMMARYs of the harvested deltas of ``parent_id`` for one environment, oldest first."""
        rows = self.rows(
            f"SELECT {_SUMMARY_COLUMNS} FROM snapshots WHERE parent = ? AND source = 'harvest'"
            " AND fingerprint_digest = ? ORDER BY created_at, id LIMIT ?",
            [parent_id, fingerprint_digest, limit],
        )
        return [summary_of(r) for r in rows]

    # -- workloads --------------------------------------------------------------------
    def put_workload(self, *, name: str, toml: str, digest: str) -> dict[str, Any]:
        now = utc_now()
        with self.writing() as db:
            db.execute(
                "INSERT INTO workloads (name, toml, digest, updated_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET toml = excluded.toml,"
                " digest = excluded.digest, updated_at = excluded.updated_at",
                [name, toml, digest, now],
            )
        return {"name": name, "digest": digest, "updated_at": now}

    def workload_row(self, name: str) -> dict[str, Any] | None:
        found = self.rows("SELECT * FROM workloads WHERE name = ?", [name])
        return found[0] if found else None

    def fingerprint_of(self, fingerprint_digest: str) -> dict[str, Any] | None:
        """The full fingerprint a stored snapshot records for ``fingerprint_digest``."""
        found = self.rows(
            "SELECT fingerprint FROM snapshots WHERE fingerprint_digest = ? LIMIT 1",
            [fingerprint_digest],
        )
        return json.loads(found[0]["fingerprint"]) if found else None

    def list_workloads(self) -> list[dict[str, Any]]:
        return self.rows("SELECT name, digest, updated_at FROM workloads ORDER BY name")

    def delete_workload(self, name: str) -> bool:
        with self.writing() as db:
            return db.execute("DELETE FROM workloads WHERE name = ?", [name]).rowcount > 0

    # -- events -----------------------------------------------------------------------
    def add_event(self, db: sqlite_utils.Database, *, kind: str, subject: str, detail: Any) -> None:
        """Append an event inside an open write transaction."""
        db.execute(
            "INSERT INTO events (at, kind, subject, detail) VALUES (?, ?, ?, ?)",
            [utc_now(), kind, subject, json.dumps(detail, sort_keys=True)],
        )

    # -- job reports ------------------------------------------------------------------
    def add_job_report(self, report: JobReport) -> tuple[int, str]:
        """Store one job report (one transaction); returns its (id, received at)."""
        now = utc_now()
        with self.writing() as db:
            cursor = db.execute(
                "INSERT INTO job_reports (at, phase, outcome, workload, fingerprint_digest,"
                " snapshot_id, node, devices, reason_code, reason, new_fxgraph, new_aotautograd,"
                " new_triton, new_other, new_bytes, started_at, finished_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    now,
                    report.phase,
                    report.outcome,
                    report.workload,
                    report.fingerprint_digest,
                    report.snapshot_id,
                    report.node,
                    json.dumps(list(report.devices)),
                    report.reason_code,
                    report.reason,
                    report.new_fxgraph,
                    report.new_aotautograd,
                    report.new_triton,
                    report.new_other,
                    report.new_bytes,
                    report.started_at,
                    report.finished_at,
                ],
            )
            return int(cursor.lastrowid or 0), now

    def job_stats(self, *, workload: str | None = None) -> list[JobStats]:
        """The job reports added up per (workload, fingerprint digest), sorted by both."""
        where, params = ("WHERE workload = ?", [workload]) if workload is not None else ("", [])
        totals = self.rows(
            "SELECT workload, fingerprint_digest,"
            " SUM(phase = 'prejob' AND outcome IN ('restored', 'already_restored')) AS restores,"
            " SUM(phase = 'prejob' AND outcome = 'cold') AS cold,"
            " SUM(phase = 'postjob') AS postjobs,"
            " SUM(phase = 'postjob' AND outcome = 'compiled') AS compiled,"
            " SUM(phase = 'postjob' AND outcome = 'compiled' AND snapshot_id IS NOT NULL)"
            " AS compiled_after_restore,"
            " SUM(CASE WHEN phase = 'postjob' AND snapshot_id IS NOT NULL"
            " THEN new_fxgraph + new_aotautograd ELSE 0 END) AS new_graphs,"
            " SUM(CASE WHEN phase = 'postjob' THEN new_bytes ELSE 0 END) AS new_bytes,"
            f" MAX(at) AS last_report_at FROM job_reports {where}"
            " GROUP BY workload, fingerprint_digest ORDER BY workload, fingerprint_digest",
            params,
        )
        reasons: dict[tuple[str, str], dict[str, int]] = {}
        for row in self.rows(
            "SELECT workload, fingerprint_digest, COALESCE(reason_code, 'unknown') AS code,"
            " COUNT(*) AS n FROM job_reports"
            f" {where + ' AND' if where else 'WHERE'} phase = 'prejob' AND outcome = 'cold'"
            " GROUP BY workload, fingerprint_digest, code",
            params,
        ):
            key = (row["workload"], row["fingerprint_digest"])
            reasons.setdefault(key, {})[row["code"]] = int(row["n"])
        return [
            JobStats(
                workload=row["workload"],
                fingerprint_digest=row["fingerprint_digest"],
                restores=int(row["restores"]),
                cold=int(row["cold"]),
                cold_reasons=reasons.get((row["workload"], row["fingerprint_digest"]), {}),
                postjobs=int(row["postjobs"]),
                compiled=int(row["compiled"]),
                compiled_after_restore=int(row["compiled_after_restore"]),
                new_graphs=int(row["new_graphs"]),
                new_bytes=int(row["new_bytes"]),
                last_report_at=row["last_report_at"],
            )
            for row in totals
        ]

    def restores_by_day(self, *, days: int = 60) -> list[tuple[str, int]]:
        """(UTC day, prejob restores that day) for the last ``days`` days with any, oldest first."""
        found = self.rows(
            "SELECT substr(at, 1, 10) AS day, COUNT(*) AS n FROM job_reports"
            " WHERE phase = 'prejob' AND outcome IN ('restored', 'already_restored')"
            " GROUP BY day ORDER BY day DESC LIMIT ?",
            [days],
        )
        return [(row["day"], int(row["n"])) for row in reversed(found)]
