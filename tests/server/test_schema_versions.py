"""server/catalog/schema.py's versions: ``PRAGMA user_version`` counts the steps a catalog
has had, each step runs once, an older catalog is brought up and a newer one refused.

The older catalog is a real data dir a server from before versions wrote
(``data/data-before-versions.tar.gz``, made by ``data/make_old_catalog.py`` at main
d398f4e: seven workloads, three snapshots and their blobs, an agent, job reports, a tier key).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlite_utils

from cachekeeper.errors import CatalogTooNew
from cachekeeper.server.catalog import Catalog, schema
from cachekeeper.server.settings import Settings
from tests.helpers.in_process import in_process
from tests.helpers.ui_data import ADMIN, EXPECTED, TOKENS

OLD_DATA_DIR = Path(__file__).parent / "data" / "data-before-versions.tar.gz"
REPO = Path(__file__).resolve().parents[2]
# The fixture's rows stay whatever the day the test runs (retention would drop its reports,
# agents and events once they are older than 90 days).
KEEP_ALL = {
    f"{table}_retention_s": 100 * 365 * 86400.0
    for table in ("reports", "agent_events", "agents", "events")
}
# The steps that shipped before versions, in their places: a step's place is its version.
SHIPPED = [
    "_create_snapshots",
    "_create_blobs",
    "_create_workloads",
    "_create_agents_events",
    "_create_agent_events",
    "_create_job_reports",
    "_add_harvest_columns",
    "_create_quarantine",
    "_create_tier_keys",
    "_add_workload_digest_column",
    "_add_job_column",
    "_create_archive_objects",
    "_add_budget_columns",
    "_add_tier_report_columns",
    "_create_migrations",
    "_identity_digests",
]


def _old_catalog(data: Path) -> Path:
    """The older server's data dir, unpacked as ``data``; its catalog's path."""
    data.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(OLD_DATA_DIR) as tar:
        tar.extractall(data.parent / "unpacked", filter="data")
    (data.parent / "unpacked" / "data").rename(data)
    return data / "meta.sqlite"


def _version(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


def _shape(path: Path) -> dict[str, object]:
    """Every table's columns (name, type, not null, default, pk), index and trigger."""
    db = sqlite3.connect(path)
    try:
        objects = db.execute(
            "SELECT type, name, tbl_name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
        ).fetchall()
        columns = {
            name: db.execute(f"PRAGMA table_info([{name}])").fetchall()
            for kind, name, _ in objects
            if kind == "table"
        }
        return {"objects": sorted(objects), "columns": columns}
    finally:
        db.close()


def _rows(path: Path) -> dict[str, int]:
    db = sqlite3.connect(path)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: db.execute(f"SELECT COUNT(*) FROM [{t}]").fetchone()[0] for t in tables}
    finally:
        db.close()


def _set_version(path: Path, version: int) -> None:
    """What a newer cachekeeper leaves: its version, written through into the file."""
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {version}")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_steps_that_shipped_keep_their_places() -> None:
    """Inserting, reordering or removing one would give a catalog's version another meaning."""
    names = [step.__name__ for step in schema._SCHEMA_STEPS]
    assert names[: len(SHIPPED)] == SHIPPED
    assert schema.latest_version() == len(names) >= len(SHIPPED)


def test_a_catalog_from_before_versions_is_brought_up_and_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _old_catalog(tmp_path / "data")
    assert _version(path) == 0  # as the older server left it
    rows_before = _rows(path)
    assert rows_before["snapshots"] == 3 and rows_before["job_reports"] == 5
    caplog.set_level(logging.INFO, logger="cachekeeper.server")
    with in_process(Settings(data_dir=tmp_path / "data", tokens=TOKENS, **KEEP_ALL)) as server:
        snapshots = server.client.get("/v1/snapshots", headers=ADMIN).json()["snapshots"]
        status = server.client.get("/v1/status", headers=ADMIN).json()["status"]
    assert f"catalog {path}: schema version 0 -> {schema.latest_version()}" in caplog.text
    assert _version(path) == schema.latest_version()
    # the same tables, columns, indexes and triggers as a catalog made new today
    Catalog.create(tmp_path / "new" / "meta.sqlite")
    assert _shape(path) == _shape(tmp_path / "new" / "meta.sqlite")
    # every row kept, and served
    assert {t: n for t, n in _rows(path).items() if t in rows_before} == rows_before
    assert sorted(s["workload"] for s in snapshots) == ["bert", "clip", "resnet"]
    assert {row["workload"] for row in status} == set(EXPECTED)


def _with_step(
    monkeypatch: pytest.MonkeyPatch, step: Callable[[sqlite_utils.Database], None]
) -> int:
    """``step`` appended to the steps (a later cachekeeper's); the version it brings."""
    monkeypatch.setattr(schema, "_SCHEMA_STEPS", [*schema._SCHEMA_STEPS, step])
    return schema.latest_version()


def _add_note_column(db: sqlite_utils.Database) -> None:
    """Not idempotent: a second run fails (``duplicate column name: note``)."""
    db.execute("ALTER TABLE snapshots ADD COLUMN note TEXT")
    db.execute("UPDATE snapshots SET note = 'added once'")


def test_a_step_runs_once_so_it_need_not_be_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before versions every step reran at every start: a second start failed on this one."""
    latest = _with_step(monkeypatch, _add_note_column)
    old = _old_catalog(tmp_path / "old")
    new = tmp_path / "new" / "meta.sqlite"
    for path in (old, new, old, new):  # each started twice
        Catalog.create(path)
        assert _version(path) == latest
    with sqlite3.connect(old) as db:
        assert db.execute("SELECT DISTINCT note FROM snapshots").fetchall() == [("added once",)]


def test_a_failed_step_leaves_the_catalog_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All the steps past a catalog's version, and its new version, commit together or not."""

    def half_then_fails(db: sqlite_utils.Database) -> None:
        db.execute("CREATE TABLE half (x)")
        raise RuntimeError("the step failed")

    path = _old_catalog(tmp_path / "data")
    shape = _shape(path)
    _with_step(monkeypatch, half_then_fails)
    with pytest.raises(RuntimeError, match="the step failed"):
        Catalog.create(path)
    assert _version(path) == 0
    assert _shape(path) == shape  # not one of the steps before it either


def test_a_catalog_from_a_newer_cachekeeper_is_refused_unwritten(tmp_path: Path) -> None:
    path = tmp_path / "meta.sqlite"
    Catalog.create(path)
    newer = schema.latest_version() + 1
    _set_version(path, newer)
    before = _sha(path)
    with pytest.raises(CatalogTooNew) as refused:
        Catalog.create(path)
    assert refused.value.detail.startswith(
        f"catalog {path} is at schema version {newer}, written by a newer cachekeeper"
        f" (this one knows versions up to {schema.latest_version()})"
    )
    assert _sha(path) == before


@pytest.mark.slow  # a `cachekeeper serve` process
def test_serve_refuses_a_newer_catalog_in_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    path = data / "meta.sqlite"
    Catalog.create(path)
    _set_version(path, schema.latest_version() + 1)
    before = _sha(path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKEEPER_")}
    env.update(CACHEKEEPER_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "cachekeeper", "serve", "--data", str(data), "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: catalog {path} is at schema version"), lines[0]
    assert "newer cachekeeper" in lines[0] and lines[0].endswith("[catalog_too_new]")
    assert _sha(path) == before
