"""The local store: save/load, prefixes, listing, and honest delete plans."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachekeeper.errors import SnapshotNotFound
from cachekeeper.snapshot.make import snapshot_dir
from cachekeeper.store import LocalStore

FP = {"schema": 1, "torch": "test", "gpus": []}


def make(store: LocalStore, root: Path, files: dict[str, bytes], workload: str) -> str:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return snapshot_dir(root, store=store, fingerprint=FP, workload=workload).id


def test_home_defaults_to_env_read_at_call_time(ck_home: Path) -> None:
    assert LocalStore().home == ck_home
    assert LocalStore().blobs.root == ck_home / "blobs"


def test_load_by_prefix_and_not_found(tmp_path: Path) -> None:
    store = LocalStore(home=tmp_path / "home")
    sid = make(store, tmp_path / "a", {"f": b"1"}, "w")
    assert store.load_manifest(sid[:8]).id == sid
    with pytest.raises(SnapshotNotFound):
        store.load_manifest("ffff" if not sid.startswith("ffff") else "0000")
    with pytest.raises(SnapshotNotFound):
        store.load_manifest("ab")  # too short to be a prefix


def test_list_reports_rows(tmp_path: Path) -> None:
    store = LocalStore(home=tmp_path / "home")
    sid = make(store, tmp_path / "a", {"f": b"12", "g": b"345"}, "drafter")
    (row,) = store.list()
    assert (row.id, row.workload, row.file_count, row.size_bytes) == (sid, "drafter", 2, 5)
    assert row.devices == ("cpu",) and row.verified is False
    assert row.created_at.tzinfo is not None


def test_remove_plan_is_honest_and_keeps_shared_blobs(tmp_path: Path) -> None:
    store = LocalStore(home=tmp_path / "home")
    a = make(store, tmp_path / "a", {"shared": b"shared", "only-a": b"aaaa"}, "a")
    b = make(store, tmp_path / "b", {"shared": b"shared", "only-b": b"bbbb"}, "b")
    before = set(store.blobs.digests())
    plan = store.plan_remove([a])
    assert plan.snapshot_ids == (a,)
    assert len(plan.blob_digests) == 1 and plan.freed_bytes > 0
    assert set(store.blobs.digests()) == before  # planning touched nothing
    assert {r.id for r in store.list()} == {a, b}
    freed = plan.execute()
    assert freed == plan.freed_bytes
    assert [r.id for r in store.list()] == [b]
    manifest_b = store.load_manifest(b)
    assert all(store.blobs.has(d) for d in manifest_b.digests)


def test_gc_deletes_only_unreferenced_blobs(tmp_path: Path) -> None:
    store = LocalStore(home=tmp_path / "home")
    sid = make(store, tmp_path / "a", {"f": b"kept"}, "w")
    orphan = store.blobs.put(
        [b"orphan"], digest=__import__("hashlib").sha256(b"orphan").hexdigest()
    )
    plan = store.plan_gc()
    assert plan.blob_digests == (orphan.digest,)
    assert plan.snapshot_ids == ()
    plan.execute()
    assert not store.blobs.has(orphan.digest)
    assert all(store.blobs.has(d) for d in store.load_manifest(sid).digests)


def test_plan_never_deletes_a_blob_a_manifest_saved_later_references(tmp_path: Path) -> None:
    store = LocalStore(home=tmp_path / "home")
    a = make(store, tmp_path / "a", {"f": b"content"}, "a")
    plan = store.plan_remove([a])
    b = make(store, tmp_path / "b", {"g": b"content"}, "b")  # saved after the plan
    plan.execute()
    assert all(store.blobs.has(d) for d in store.load_manifest(b).digests)
