"""The catalog's tables: their ``CREATE`` statements, indexes and in-place migrations.

Tables::

    snapshots       id (manifest sha256), workload, fingerprint_digest, fingerprint (JSON),
                    devices (JSON), verified, signed, stats (JSON), size_bytes, file_count,
                    created_at, last_used_at, pinned, manifest (JSON text, signature included),
                    source ("harvest" or NULL), parent (a harvested delta's parent id),
                    workload_digest (the manifest's: the workload TOML it was built from)
    blobs           digest, size_bytes (uncompressed), stored_bytes (zstd at rest),
                    created_at, last_access_at
    snapshot_blobs  (snapshot_id, digest): which blobs each snapshot references
    workloads       name, toml, digest (sha256 of the TOML text), updated_at
    agents          id, name, fingerprint_digest, fingerprint (JSON), devices (JSON),
                    registered_at, last_seen_at, info (JSON: gpus, version)
    events          an audit log (snapshot.published, snapshot.evicted, ...)
    job_reports     what training jobs report (POST /v1/reports): phase (prejob, postjob),
                    outcome, workload, fingerprint_digest, snapshot_id, node, devices
                    (JSON), reason_code, reason, new_fxgraph, new_aotautograd, new_triton,
                    new_other, new_bytes, started_at, finished_at, at (received),
                    job (the job's identity: reports of one job on one node count once),
                    token_id (who sent it: ``server.auth.token_id``; NULL with auth off),
                    size_bytes (its text's bytes, what ``reports_max_bytes`` counts)
    quarantine      id, at, reason, manifest: snapshots the start-up check took out of
                    service because blobs they reference are gone (re-push to restore)
    archive_objects snapshot_id, etag, size_bytes: the object-store archive as this server
                    wrote it at publish; an object whose ETag differs was changed behind
                    the server's back (a re-push packs it again; the archive route then
                    builds the stream from the blobs instead)
    agent_events    what agents report per (workload, fingerprint_digest): building, built,
                    skipped, cold_compile_broken, failed (see server/resources/fleet.py); size_bytes
    table_usage     name, rows, bytes: job_reports' and agent_events' totals, kept by
                    triggers in the same transaction as each insert and delete, so the
                    budgets (server/budgets.py) read them without a scan
    tier_keys       the per-key tier (server/resources/tier.py): key (torch's, as bytes), digest of
                    the value in the tier's blob store, size_bytes, stored_bytes,
                    created_at, last_used_at, writer (JSON: who wrote it, from where)
    migrations      name, at: the one-time data migrations this catalog has had

Every table a client writes has a bound and a retention (``server/budgets.py``, whose
docstring lists them). Times are UTC ISO 8601 text with microseconds (``cachekeeper.wire.utc_now``), so they sort as
text. Part of the catalog layer: only ``server/catalog/database.py`` calls ``ensure_schema``.

Versions. A catalog's schema version is how many of ``_SCHEMA_STEPS`` it has had,
recorded in SQLite's ``PRAGMA user_version`` (the database header's own integer, written
in the same transaction as the steps). ``ensure_schema`` runs the steps past it, in order,
then records their count (``latest_version``): each step runs once per catalog, so a step need not be
idempotent (a rename, a table rebuilt, rows rewritten once), and a failed step leaves
the catalog at its old version with none of the steps applied (the caller's transaction
rolls back). Two cases are told apart from the version alone:

- version 0: a new, empty file, or a catalog written before versions (cachekeeper before
  issue 33, whose every start reran every step). Either way every step runs, which is why
  the steps from before versions (the first 15, through ``_identity_digests``) stay idempotent: they meet tables that exist. A step
  appended since meets a catalog that never had it, so it runs once there too.
- a version above ``latest_version()``: written by a newer cachekeeper, whose steps this
  one does not know. ``check_version`` refuses it (``CatalogTooNew``, one line) before
  anything is written.

Adding a table or a column is appending one function to ``_SCHEMA_STEPS`` (taking the
database, run inside the write transaction); its queries go in the module of the resource
that holds it (``server/resources/``). A step's place in the list is its version: never insert,
reorder, remove or edit a step that has shipped (a catalog past it would never see the
change); append another.

A one-time data migration that predates versions (``_identity_digests``) also records its
name in ``migrations``, so that a catalog from before versions runs it once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import sqlite_utils

from cachekeeper.environment.fingerprint import digest_of
from cachekeeper.errors import CatalogTooNew
from cachekeeper.wire import utc_now

__all__ = [
    "EVENT_BYTES_SQL",
    "REPORT_BYTES_SQL",
    "agent_id_for",
    "check_version",
    "ensure_schema",
    "latest_version",
    "recount_usage",
    "schema_version",
]


def agent_id_for(name: str) -> str:
    """The id of the agent named ``name`` (the ``agents`` table's key): one agent per name,
    whatever its environment (a changed environment updates the agent; it is not a second
    one). Before issue 31 the id also hashed the fingerprint digest, so an agent started
    again in another shell showed up twice under one name (``_one_agent_per_name``)."""
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def recount_usage(db: sqlite_utils.Database) -> None:
    """Count ``table_usage`` again where its rows disagree with the table's (start-up, in
    ``Catalog.create``'s transaction: a catalog rebuilt by ``sqlite3 .recover`` keeps totals
    of rows it lost). Counting rows reads an index (40 ms for a million reports); summing
    bytes reads the table (0.6 s), so only a table whose count is off is summed."""
    for table in ("job_reports", "agent_events"):
        rows = int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
        found = db.execute("SELECT rows FROM table_usage WHERE name = ?", [table]).fetchone()
        if rows != (0 if found is None else int(found[0])):
            db.execute(
                f"UPDATE table_usage SET rows = ?, bytes ="
                f" (SELECT COALESCE(SUM(size_bytes), 0) FROM {table}) WHERE name = ?",
                [rows, table],
            )


def latest_version() -> int:
    """The version this cachekeeper brings a catalog to: how many steps it knows."""
    return len(_SCHEMA_STEPS)


def schema_version(db: sqlite_utils.Database) -> int:
    """The catalog's recorded schema version (0: new, or written before versions)."""
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def check_version(db: sqlite_utils.Database, *, name: str) -> int:
    """The catalog's version; ``CatalogTooNew`` naming ``name`` (its file) when a newer
    cachekeeper wrote it. Reads only."""
    found, latest = schema_version(db), latest_version()
    if found > latest:
        raise CatalogTooNew(
            f"catalog {name} is at schema version {found}, written by a newer cachekeeper"
            f" (this one knows versions up to {latest}); the server will not serve"
            " it: run the cachekeeper that wrote it, or restore a backup made before the"
            " upgrade"
        )
    return found


def ensure_schema(db: sqlite_utils.Database, *, name: str) -> tuple[int, int]:
    """Run the steps past the catalog's version and record the latest, inside the caller's
    write transaction; (the version found, the version now). ``CatalogTooNew`` as
    ``check_version``."""
    found = check_version(db, name=name)
    steps = list(_SCHEMA_STEPS)
    for step in steps[found:]:
        step(db)
    if found != len(steps):
        db.execute(f"PRAGMA user_version = {len(steps):d}")
    return found, len(steps)


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


def _add_harvest_columns(db: sqlite_utils.Database) -> None:
    """``source`` and ``parent`` (harvested deltas), added to older databases in place."""
    table = db.table("snapshots")
    for name in ("source", "parent"):
        if name not in table.columns_dict:
            table.add_column(name, str)
    table.create_index(["parent"], if_not_exists=True)


def _add_workload_digest_column(db: sqlite_utils.Database) -> None:
    """``workload_digest`` (the status's staleness test), filled from the manifests once."""
    table = db.table("snapshots")
    if "workload_digest" not in table.columns_dict:
        table.add_column("workload_digest", str)
        db.execute(
            "UPDATE snapshots SET workload_digest = json_extract(manifest, '$.workload_digest')"
        )


def _add_job_column(db: sqlite_utils.Database) -> None:
    """``job`` (a report's job identity, ``JobReport.job``), added to older databases."""
    table = db.table("job_reports")
    if "job" not in table.columns_dict:
        table.add_column("job", str)


# What a job report's and an agent event's text weighs (``size_bytes``), in SQL for the rows
# of an older database; ``server/budgets.py`` computes the same for new rows.
REPORT_BYTES_SQL = (
    "160 + LENGTH(CAST(COALESCE(workload, '') AS BLOB)) + LENGTH(CAST(COALESCE(node, '') AS BLOB))"
    " + LENGTH(CAST(COALESCE(devices, '') AS BLOB)) + LENGTH(CAST(COALESCE(reason, '') AS BLOB))"
    " + LENGTH(CAST(COALESCE(reason_code, '') AS BLOB))"
    " + LENGTH(CAST(COALESCE(started_at, '') AS BLOB))"
    " + LENGTH(CAST(COALESCE(finished_at, '') AS BLOB)) + LENGTH(CAST(COALESCE(job, '') AS BLOB))"
)
EVENT_BYTES_SQL = (
    "200 + LENGTH(CAST(COALESCE(workload, '') AS BLOB)) + LENGTH(CAST(COALESCE(detail, '') AS BLOB))"
    " + LENGTH(CAST(COALESCE(traceback_tail, '') AS BLOB))"
)


def _add_budget_columns(db: sqlite_utils.Database) -> None:
    """``token_id`` and ``size_bytes`` on job reports, ``size_bytes`` on agent events (older
    rows get their weight once), and ``table_usage`` with the triggers that keep it."""
    reports, events = db.table("job_reports"), db.table("agent_events")
    if "token_id" not in reports.columns_dict:
        reports.add_column("token_id", str)
    for table, weight in ((reports, REPORT_BYTES_SQL), (events, EVENT_BYTES_SQL)):
        if "size_bytes" not in table.columns_dict:
            table.add_column("size_bytes", int)
            db.execute(f"UPDATE {table.name} SET size_bytes = {weight}")
    # by time: the retention's oldest rows, and a token's window read back after a start
    reports.create_index(["at"], if_not_exists=True)
    events.create_index(["at"], if_not_exists=True)
    db.execute(
        "CREATE TABLE IF NOT EXISTS table_usage"
        " (name TEXT PRIMARY KEY, rows INTEGER NOT NULL, bytes INTEGER NOT NULL)"
    )
    for name in ("job_reports", "agent_events"):
        if db.execute("SELECT 1 FROM table_usage WHERE name = ?", [name]).fetchone() is None:
            db.execute(  # once: from then on the triggers keep it
                "INSERT INTO table_usage (name, rows, bytes)"
                f" SELECT '{name}', COUNT(*), COALESCE(SUM(size_bytes), 0) FROM {name}"
            )
        db.execute(
            f"CREATE TRIGGER IF NOT EXISTS {name}_usage_insert AFTER INSERT ON {name} BEGIN"
            " UPDATE table_usage SET rows = rows + 1,"
            f" bytes = bytes + COALESCE(NEW.size_bytes, 0) WHERE name = '{name}'; END"
        )
        db.execute(
            f"CREATE TRIGGER IF NOT EXISTS {name}_usage_delete AFTER DELETE ON {name} BEGIN"
            " UPDATE table_usage SET rows = rows - 1,"
            f" bytes = bytes - COALESCE(OLD.size_bytes, 0) WHERE name = '{name}'; END"
        )


def _add_tier_report_columns(db: sqlite_utils.Database) -> None:
    """A postjob's per-key tier counts (``JobReport.tier`` ...), added to older databases."""
    table = db.table("job_reports")
    columns = {
        "tier": str,
        "snapshot_hits": int,
        "tier_hits": int,
        "tier_puts": int,
        "tier_failed": int,
        "tier_problem": str,
    }
    for name, kind in columns.items():
        if name not in table.columns_dict:
            table.add_column(name, kind)


def _create_quarantine(db: sqlite_utils.Database) -> None:
    db.table("quarantine").create(
        {"id": str, "at": str, "reason": str, "manifest": str}, pk="id", if_not_exists=True
    )


def _create_tier_keys(db: sqlite_utils.Database) -> None:
    db.table("tier_keys").create(
        {
            "key": bytes,
            "digest": str,
            "size_bytes": int,
            "stored_bytes": int,
            "created_at": str,
            "last_used_at": str,
            "writer": str,
        },
        pk="key",
        not_null=["digest", "size_bytes", "stored_bytes", "created_at", "last_used_at"],
        if_not_exists=True,
    )
    db.table("tier_keys").create_index(["last_used_at"], if_not_exists=True)
    db.table("tier_keys").create_index(["digest"], if_not_exists=True)


def _create_migrations(db: sqlite_utils.Database) -> None:
    db.table("migrations").create({"name": str, "at": str}, pk="name", if_not_exists=True)


def _identity_digests(db: sqlite_utils.Database) -> None:
    """Issue 31, once: every stored digest becomes the fingerprint's identity
    (``fingerprint.digest_of``, without provenance such as ``cpu.threads_from``), and agents
    get one id per name.

    Snapshots and agents hold their fingerprint, so their digest is computed again; agent
    events and job reports hold only a digest, which is translated when a stored
    fingerprint had it (``map``), and kept otherwise (a node's cold report whose
    fingerprint the server never held). Agents of one name merge into the one seen last,
    their events kept under its id. Snapshot ids and manifests do not change (a manifest's
    ``fingerprint_digest`` key keeps its meaning: cachekeeper/snapshot/manifest.py).
    """
    name = "identity-digests"
    if db.execute("SELECT 1 FROM migrations WHERE name = ?", [name]).fetchone():
        return
    moved: dict[str, str] = {}  # the digest before -> the identity
    for table, key in (("snapshots", "id"), ("agents", "id")):
        rows = db.execute(f"SELECT {key}, fingerprint_digest, fingerprint FROM {table}")
        for row_id, before, text in rows.fetchall():
            try:
                after = digest_of(json.loads(text))
            except (TypeError, ValueError):  # a row an older server took unchecked: left
                continue
            if after != before:
                moved[before] = after
                db.execute(
                    f"UPDATE {table} SET fingerprint_digest = ? WHERE {key} = ?", [after, row_id]
                )
    for before, after in moved.items():
        for table in ("agent_events", "job_reports"):
            db.execute(
                f"UPDATE {table} SET fingerprint_digest = ? WHERE fingerprint_digest = ?",
                [after, before],
            )
    _one_agent_per_name(db)
    db.execute("INSERT INTO migrations (name, at) VALUES (?, ?)", [name, utc_now()])


def _one_agent_per_name(db: sqlite_utils.Database) -> None:
    """Give every agent the id of its name (``agent_id_for``); of several agents of one
    name, keep the one seen last, and move the others' events to it."""
    rows = db.execute(
        "SELECT id, name FROM agents ORDER BY name, last_seen_at DESC, registered_at DESC"
    ).fetchall()
    kept: set[str] = set()
    for old_id, agent_name in rows:
        new_id = agent_id_for(agent_name)
        if old_id != new_id:
            db.execute("UPDATE agent_events SET agent_id = ? WHERE agent_id = ?", [new_id, old_id])
        if agent_name in kept:
            db.execute("DELETE FROM agents WHERE id = ?", [old_id])
            continue
        kept.add(agent_name)
        if old_id != new_id:
            db.execute("UPDATE agents SET id = ? WHERE id = ?", [new_id, old_id])


def _create_archive_objects(db: sqlite_utils.Database) -> None:
    db.table("archive_objects").create(
        {"snapshot_id": str, "etag": str, "size_bytes": int}, pk="snapshot_id", if_not_exists=True
    )


# A step's place is its version: append, never insert, reorder, remove or edit (docstring).
_SCHEMA_STEPS: list[Callable[[sqlite_utils.Database], None]] = [
    _create_snapshots,
    _create_blobs,
    _create_workloads,
    _create_agents_events,
    _create_agent_events,
    _create_job_reports,
    _add_harvest_columns,
    _create_quarantine,
    _create_tier_keys,
    _add_workload_digest_column,
    _add_job_column,
    _create_archive_objects,
    _add_budget_columns,
    _add_tier_report_columns,
    _create_migrations,
    _identity_digests,
]
