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
                    job (the job's identity: reports of one job on one node count once)
    quarantine      id, at, reason, manifest: snapshots the start-up check took out of
                    service because blobs they reference are gone (re-push to restore)
    archive_objects snapshot_id, etag, size_bytes: the object-store archive as this server
                    wrote it at publish; an object whose ETag differs was changed behind
                    the server's back (a re-push packs it again; the archive route then
                    builds the stream from the blobs instead)
    agent_events    what agents report per (workload, fingerprint_digest): building, built,
                    skipped, cold_compile_broken, failed (see server/fleet.py)
    tier_keys       the per-key tier (server/tier.py): key (torch's, as bytes), digest of
                    the value in the tier's blob store, size_bytes, stored_bytes,
                    created_at, last_used_at, writer (JSON: who wrote it, from where)

Times are UTC ISO 8601 text with microseconds (``cachekeeper.wire.utc_now``), so they sort as
text. Part of the catalog layer: only ``server/catalog/core.py`` calls ``ensure_schema``.

Adding a table or a column: add an idempotent step to ``_SCHEMA_STEPS``
(``if_not_exists=True``, or a column added only when absent, as ``_add_harvest_columns``);
its queries go in ``server/catalog/core.py`` or ``server/catalog/fleet.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlite_utils

__all__ = ["ensure_schema"]


def ensure_schema(db: sqlite_utils.Database) -> None:
    """Create the tables and indexes that are missing and migrate older databases in place
    (every step is idempotent); run inside the caller's write transaction."""
    for step in _SCHEMA_STEPS:
        step(db)


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


def _create_archive_objects(db: sqlite_utils.Database) -> None:
    db.table("archive_objects").create(
        {"snapshot_id": str, "etag": str, "size_bytes": int}, pk="snapshot_id", if_not_exists=True
    )


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
    _add_tier_report_columns,
]
