"""GC and the size cap keep what kept snapshots reference; a restart keeps everything."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from cachekeeper.server.settings import Settings
from tests.helpers.live_server import start_server
from tests.helpers.metrics import sample, scrape
from tests.server.conftest import FINGERPRINT, make_snapshot, push, random_files


def _stored(live) -> set[str]:  # type: ignore[no-untyped-def]
    return {p.name[:-4] for p in (live.settings.data_dir / "blobs").glob("??/??/*.zst")}


def test_gc_evicts_lru_unpinned_and_keeps_referenced_blobs(fresh_server) -> None:  # type: ignore[no-untyped-def]
    live = fresh_server(gc_grace_s=0)
    shared = {"shared.bin": b"S" * 5000}
    snaps = []
    with httpx.Client(base_url=live.url) as c:
        for i in range(3):
            files = shared | random_files(2, size=20_000, seed=i, prefix=f"s{i}")
            manifest, blobs = make_snapshot(files, workload=f"w{i}")
            assert push(c, manifest, blobs).status_code == 201
            snaps.append((manifest, blobs))
        orphan = b"never published"
        orphan_digest = hashlib.sha256(orphan).hexdigest()
        c.put(f"/v1/blobs/{orphan_digest}", content=orphan)
        c.post(f"/v1/snapshots/{snaps[0][0].id}/pin")
        # snapshot 2 was used recently, so snapshot 1 is least recently used among unpinned
        c.post("/v1/resolve", json={"fingerprint": FINGERPRINT, "workload": "w2"})

        plain = c.post("/v1/gc", json={"dry_run": False}).json()
        assert plain["snapshots_evicted"] == []  # no cap: only the orphan goes
        assert plain["blobs_deleted"] == 1 and orphan_digest not in _stored(live)

        live.settings.max_store_bytes = _store_bytes(c) - 1  # evict until one byte is freed
        dry = c.post("/v1/gc", json={"dry_run": True}).json()
        assert dry["dry_run"] and dry["snapshots_evicted"] == [snaps[1][0].id]
        assert c.get(f"/v1/snapshots/{snaps[1][0].id}").status_code == 200  # dry run kept it

        wet = c.post("/v1/gc", json={"dry_run": False}).json()
        assert wet["snapshots_evicted"] == [snaps[1][0].id]
        assert wet["bytes_freed"] > 0 and wet["blobs_deleted"] == 2
        assert c.get(f"/v1/snapshots/{snaps[1][0].id}").status_code == 404
        kept = _stored(live)
        for manifest, _ in (snaps[0], snaps[2]):
            assert manifest.digests <= kept  # every blob of a kept snapshot survives
            assert c.get(f"/v1/snapshots/{manifest.id}/archive").status_code == 200
        assert sample(c.get("/metrics").text, "cachekeeper_evictions_total") == 1


def _store_bytes(c: httpx.Client) -> int:
    return int(scrape(c, "cachekeeper_store_bytes"))


def test_hard_cap_answers_507_and_only_gc_evicts(fresh_server) -> None:  # type: ignore[no-untyped-def]
    live = fresh_server(max_store_bytes=30_000, gc_grace_s=0)
    rng = __import__("random").Random(3)
    with httpx.Client(base_url=live.url) as c:
        first = rng.randbytes(20_000)
        manifest, blobs = make_snapshot({"a": first})
        assert push(c, manifest, blobs).status_code == 201
        c.post(f"/v1/snapshots/{manifest.id}/pin")
        second = rng.randbytes(20_000)
        r = c.put(f"/v1/blobs/{hashlib.sha256(second).hexdigest()}", content=second)
        assert r.status_code == 507 and r.json()["error"] == "insufficient_storage"
        # Unpinned, it is still kept: an upload never evicts (issue 18.3), an admin's GC does.
        c.delete(f"/v1/snapshots/{manifest.id}/pin")
        r = c.put(f"/v1/blobs/{hashlib.sha256(second).hexdigest()}", content=second)
        assert r.status_code == 507, r.text
        assert c.get(f"/v1/snapshots/{manifest.id}").status_code == 200
        live.settings.max_store_bytes = 10_000  # GC evicts down to the cap
        assert c.post("/v1/gc", json={}).json()["snapshots_evicted"] == [manifest.id]
        live.settings.max_store_bytes = 30_000
        r = c.put(f"/v1/blobs/{hashlib.sha256(second).hexdigest()}", content=second)
        assert r.status_code == 201, r.text
        assert c.get(f"/v1/snapshots/{manifest.id}").status_code == 404


def test_delete_snapshot_then_gc(fresh_server) -> None:  # type: ignore[no-untyped-def]
    live = fresh_server(gc_grace_s=0)
    with httpx.Client(base_url=live.url) as c:
        manifest, blobs = make_snapshot(random_files(2, seed=9))
        push(c, manifest, blobs)
        assert c.delete(f"/v1/snapshots/{manifest.id}").status_code == 204
        assert c.delete(f"/v1/snapshots/{manifest.id}").status_code == 404
        assert c.post("/v1/gc", json={}).json()["blobs_deleted"] == 2
        assert _stored(live) == set()


def test_restart_keeps_everything(tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(data_dir=tmp_path / "data")
    first = start_server(settings)
    manifest, blobs = make_snapshot(random_files(4, seed=5), workload="persist")
    try:
        with httpx.Client(base_url=first.url) as c:
            assert push(c, manifest, blobs).status_code == 201
            c.post(f"/v1/snapshots/{manifest.id}/pin")
    finally:
        first.stop()
    # a crashed upload leaves a temp file: the next start sweeps it, and it is never a blob
    tmp_dir = tmp_path / "data" / "blobs" / ".tmp"
    (tmp_dir / ("ab" * 32 + ".partial")).write_bytes(b"half")
    second = start_server(Settings(data_dir=tmp_path / "data"))
    try:
        with httpx.Client(base_url=second.url) as c:
            summary = c.get("/v1/snapshots", params={"workload": "persist"}).json()["snapshots"]
            assert [s["id"] for s in summary] == [manifest.id] and summary[0]["pinned"]
            assert (
                c.post("/v1/blobs/missing", json={"digests": sorted(blobs)}).json()["missing"] == []
            )
            for digest, data in blobs.items():
                assert c.get(f"/v1/blobs/{digest}").content == data
        assert list(tmp_dir.iterdir()) == []
    finally:
        second.stop()


def test_upload_cut_off_midway_leaves_no_blob(live_cut) -> None:  # type: ignore[no-untyped-def]
    """The client drops the connection 300 KB into a 1 MB upload, while the server is
    writing it: the temp file goes, no blob appears. The cut waits until the temp file is
    there, so the test cannot pass by cutting before the server began (it did, with a
    sleep, and could not tell)."""
    import socket
    import time

    data = b"q" * 1_000_000
    digest = hashlib.sha256(data).hexdigest()
    tmp_dir = live_cut.settings.data_dir / "blobs" / ".tmp"

    def partials() -> list[object]:
        return list(tmp_dir.iterdir()) if tmp_dir.exists() else []

    sock = socket.create_connection(("127.0.0.1", live_cut.port))
    sock.sendall(
        f"PUT /v1/blobs/{digest} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data[:300_000]
    )
    deadline = time.monotonic() + 10
    while not partials():
        assert time.monotonic() < deadline, "the server never began writing the upload"
        time.sleep(0.01)
    sock.close()  # mid-write: a temp file is on disk
    deadline = time.monotonic() + 10
    while partials():
        assert time.monotonic() < deadline, f"the cut upload's temp file stayed: {partials()}"
        time.sleep(0.05)
    assert _stored(live_cut) == set()
    with httpx.Client(base_url=live_cut.url) as c:
        assert c.post("/v1/blobs/missing", json={"digests": [digest]}).json()["missing"] == [digest]


@pytest.fixture
def live_cut(fresh_server):  # type: ignore[no-untyped-def]
    return fresh_server()
