"""server/catalog/ on a real SQLite file: one ``writing()`` block is one transaction."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cachekeeper.errors import InsufficientStorage
from cachekeeper.server.catalog import Catalog
from cachekeeper.server.resources.blobs import blob_usage, record_blob
from cachekeeper.server.resources.snapshots import (
    insert_snapshot,
    snapshot_blobs,
    snapshot_exists,
    summary,
)
from cachekeeper.server.resources.workloads import list_workloads, put_workload
from cachekeeper.snapshot.manifest import FileEntry, Manifest

FINGERPRINT = {"schema": 1, "torch": "2.13.0+cpu", "driver": None, "gpus": [], "env": {}}


class Injected(Exception):
    """Raised by the tests inside a write block."""


def _manifest(n: int) -> Manifest:
    files = tuple(FileEntry(path=f"d/f{i}", digest=f"{i:064x}", size_bytes=1) for i in range(n))
    return Manifest(files=files, fingerprint=FINGERPRINT, devices=("cpu",), workload="w")


def test_two_inserts_then_an_exception_leave_neither(tmp_path: Path) -> None:
    catalog = Catalog.create(tmp_path / "meta.sqlite")
    with pytest.raises(Injected):
        with catalog.writing() as tx:
            put_workload(tx, name="a", toml="name = 'a'", digest="a" * 64)
            put_workload(tx, name="b", toml="name = 'b'", digest="b" * 64)
            raise Injected
    assert list_workloads(catalog) == []
    with catalog.writing() as tx:  # the connection is usable afterwards
        put_workload(tx, name="c", toml="name = 'c'", digest="c" * 64)
    assert [w.name for w in list_workloads(catalog)] == ["c"]


def test_a_failed_publish_leaves_no_snapshot_and_no_references(tmp_path: Path) -> None:
    """sqlite-utils' ``insert``/``insert_all`` join the open transaction (a savepoint inside
    it) instead of committing on their own: 1,200 references (three insert batches), then
    an exception, and neither the snapshot row nor any reference is left."""
    catalog = Catalog.create(tmp_path / "meta.sqlite")
    manifest = _manifest(1200)
    with catalog.writing() as tx:
        for entry in manifest.files:
            record_blob(tx, digest=entry.digest, size_bytes=1, stored_bytes=10)
    with pytest.raises(Injected):
        with catalog.writing() as tx:
            insert_snapshot(tx, manifest, created_at="2026-01-01T00:00:00+00:00")
            assert snapshot_exists(tx, manifest.id)  # visible inside the transaction
            raise Injected
    assert summary(catalog, manifest.id) is None
    assert snapshot_blobs(catalog, manifest.id) == {}
    assert [u.refs for u in blob_usage(catalog)] == [0] * 1200


def test_readers_never_see_a_transaction_half_done(tmp_path: Path) -> None:
    """Another thread (its own connection) reads while a publish is between its snapshot
    row and its references: it sees no snapshot at all."""
    catalog = Catalog.create(tmp_path / "meta.sqlite")
    manifest = _manifest(600)
    with catalog.writing() as tx:
        for entry in manifest.files:
            record_blob(tx, digest=entry.digest, size_bytes=1, stored_bytes=10)
    seen: list[object] = []
    with catalog.writing() as tx:
        insert_snapshot(tx, manifest, created_at="2026-01-01T00:00:00+00:00")
        reader = threading.Thread(target=lambda: seen.append(summary(catalog, manifest.id)))
        reader.start()
        reader.join(30)
    assert seen == [None]
    assert len(snapshot_blobs(catalog, manifest.id)) == 600


def test_a_full_disk_is_insufficient_storage_and_rolls_back(tmp_path: Path) -> None:
    """The full disk is SQLite's own: ``PRAGMA max_page_count`` caps this connection's
    database file, so the write fails with SQLITE_FULL exactly as on a full disk."""
    catalog = Catalog.create(tmp_path / "meta.sqlite")
    db = catalog.db()
    pages = next(iter(db.execute("PRAGMA page_count").fetchone()))
    db.execute(f"PRAGMA max_page_count = {pages + 8}")
    manifest = _manifest(3000)  # its row and references need far more than 8 pages
    with catalog.writing() as tx:
        put_workload(tx, name="kept", toml="name = 'kept'", digest="0" * 64)
    with pytest.raises(InsufficientStorage, match="disk is full"):
        with catalog.writing() as tx:
            for entry in manifest.files:
                record_blob(tx, digest=entry.digest, size_bytes=1, stored_bytes=10)
            insert_snapshot(tx, manifest, created_at="2026-01-01T00:00:00+00:00")
    assert summary(catalog, manifest.id) is None
    assert blob_usage(catalog) == []
    assert [w.name for w in list_workloads(catalog)] == ["kept"]
