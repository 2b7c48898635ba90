"""Publishing under faults: the server SIGKILLed mid-publish, a nearly full disk, and
half-published snapshots left by an older server (issue 18.1).

A publish is one SQLite transaction (server/catalog/database.py ``writing()``), so a snapshot is
listed with all of its blob references or not at all. The blobs are written into the
data dir directly (``_stock``: what finished uploads leave, files then rows), so the
tests spend their time on the publish, not on thousands of uploads.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import sqlite3
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import zstandard

from cachekeeper.backends.local import LocalBackend
from cachekeeper.server.catalog import Catalog
from cachekeeper.server.resources.blobs import record_blob
from cachekeeper.server.settings import Settings
from cachekeeper.snapshot.manifest import FileEntry, Manifest
from tests.hardening.conftest import ServerProcess
from tests.helpers.live_server import start_server

FINGERPRINT = {"schema": 1, "torch": "2.13.0+cpu", "driver": None, "gpus": [], "env": {}}


def _stock(data_dir: Path, *, blobs: int, files: int | None = None, tag: str = "") -> Manifest:
    """Store ``blobs`` distinct small blobs in ``data_dir`` (file, then row) and return a
    manifest of ``files`` entries (default: one per blob) that uses every one of them."""
    store = LocalBackend(data_dir / "blobs")
    catalog = Catalog.create(data_dir / "meta.sqlite")
    digests = []
    with catalog.writing() as tx:
        for i in range(blobs):
            content = f"{tag} blob {i}".encode()
            digest = hashlib.sha256(content).hexdigest()
            path = store.path_for(digest)
            path.parent.mkdir(parents=True, exist_ok=True)
            frame = zstandard.ZstdCompressor().compress(content)
            path.write_bytes(frame)
            record_blob(tx, digest=digest, size_bytes=len(content), stored_bytes=len(frame))
            digests.append((digest, len(content)))
    entries = tuple(
        FileEntry(path=f"{tag}d{i % 97}/f{i:06d}.bin", digest=d, size_bytes=n)
        for i, (d, n) in enumerate(digests[i % blobs] for i in range(files or blobs))
    )
    return Manifest(files=entries, fingerprint=FINGERPRINT, devices=("cpu",), workload=tag or "w")


def _archive_blobs(c: httpx.Client, snapshot_id: str) -> int:
    """How many blobs the snapshot's archive stream carries (it must end cleanly)."""
    answer = c.get(f"/v1/snapshots/{snapshot_id}/archive")
    assert answer.status_code == 200, answer.text[:300]
    raw = zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO(answer.content), read_across_frames=True
    )
    with tarfile.open(fileobj=raw, mode="r|") as tar:
        return sum(1 for m in tar if m.name.startswith("blobs/"))


def _references(data_dir: Path, snapshot_id: str) -> int | None:
    """The snapshot's reference count as committed (None when it has no row)."""
    db = sqlite3.connect(f"file:{data_dir / 'meta.sqlite'}?mode=ro", uri=True)
    try:
        if db.execute("SELECT 1 FROM snapshots WHERE id = ?", [snapshot_id]).fetchone() is None:
            return None
        sql = "SELECT COUNT(*) FROM snapshot_blobs WHERE snapshot_id = ?"
        return int(db.execute(sql, [snapshot_id]).fetchone()[0])
    finally:
        db.close()


def test_server_killed_during_publish_never_leaves_a_half_published_snapshot(
    server_process: ServerProcess, reliability
) -> None:
    """SIGKILL during ``POST /v1/snapshots`` of a 6,000-blob manifest: twice the moment the
    snapshot's row becomes visible to another connection (before the fix, its references
    were still being written then), twice at a random point of the publish."""
    data_dir = server_process.data_dir
    manifest = _stock(data_dir, blobs=6000)
    body = manifest.to_json().encode()
    rng = random.Random(18)
    server_process.start()
    started = time.monotonic()
    with httpx.Client(base_url=server_process.url, timeout=120) as c:
        assert c.post("/v1/snapshots", content=body).status_code == 201
        publish_s = time.monotonic() - started
        assert c.delete(f"/v1/snapshots/{manifest.id}").status_code == 204
    server_process.kill()
    kills = 0
    for attempt in range(4):
        server_process.start()
        sender = threading.Thread(
            target=lambda: _post_ignoring_errors(server_process.url, body), daemon=True
        )
        sender.start()
        if attempt < 2:  # the moment the row is committed
            deadline = time.monotonic() + 120
            while _references(data_dir, manifest.id) is None and time.monotonic() < deadline:
                time.sleep(0.0005)
        else:
            time.sleep(rng.uniform(0.0, publish_s))
        server_process.kill()
        kills += 1
        sender.join(30)
        server_process.start()  # the start-up check runs on the same data dir
        refs = _references(data_dir, manifest.id)
        assert refs in (None, 6000), f"half-published: {refs} of 6000 references"
        with httpx.Client(base_url=server_process.url, timeout=120) as c:
            listed = [s["id"] for s in c.get("/v1/snapshots").json()["snapshots"]]
            assert listed == ([] if refs is None else [manifest.id])
            again = c.post("/v1/snapshots", content=body)
            assert again.status_code == (201 if refs is None else 200), again.text[:300]
            assert _archive_blobs(c, manifest.id) == 6000
            assert c.delete(f"/v1/snapshots/{manifest.id}").status_code == 204
        server_process.kill()
    reliability.record(
        "server SIGKILLed during the publish of a 6,000-blob manifest (2 at the commit,"
        " 2 at random points)",
        tries=kills,
        outcome="kept",
        area="server killed",
    )
    reliability.record(
        "publish of the same manifest after the server's restart",
        tries=kills,
        outcome="recovered",
        area="server killed",
    )


def _post_ignoring_errors(url: str, body: bytes) -> None:
    try:
        httpx.post(f"{url}/v1/snapshots", content=body, timeout=120)
    except httpx.HTTPError:
        pass  # the server was killed under it


def test_startup_check_completes_or_quarantines_half_published_snapshots(
    tmp_path: Path, reliability
) -> None:
    """What an older server left after a SIGKILL mid-publish is written into the catalog
    by hand (references deleted with sqlite3): snapshot A lost 700 of its 1,200 references,
    snapshot B lost all of them and one of its blob files is gone too."""
    data_dir = tmp_path / "data"
    a = _stock(data_dir, blobs=1200, tag="a")
    b = _stock(data_dir, blobs=40, tag="b")
    with start_server(Settings(data_dir=data_dir)) as live, httpx.Client(base_url=live.url) as c:
        for manifest in (a, b):
            assert c.post("/v1/snapshots", content=manifest.to_json()).status_code == 201
        # While it runs: a re-publish completes a snapshot that lacks references.
        _drop_references(data_dir, a.id, keep=600)
        assert c.post("/v1/snapshots", content=a.to_json()).json()["created"] is False
        assert _references(data_dir, a.id) == 1200
    _drop_references(data_dir, a.id, keep=500)
    _drop_references(data_dir, b.id, keep=0)
    gone = sorted(b.digests)[0]
    LocalBackend(data_dir / "blobs").path_for(gone).unlink()
    with start_server(Settings(data_dir=data_dir)) as live, httpx.Client(base_url=live.url) as c:
        assert _references(data_dir, a.id) == 1200  # completed: every blob is there
        assert _archive_blobs(c, a.id) == 1200
        assert _references(data_dir, b.id) is None  # quarantined: a blob is gone
        assert c.get(f"/v1/snapshots/{b.id}").status_code == 404
        missing = c.post("/v1/blobs/missing", json={"digests": sorted(b.digests)}).json()
        assert missing["missing"] == [gone]
        content = next(f"b blob {i}".encode() for i in range(40) if _sha(f"b blob {i}") == gone)
        assert c.put(f"/v1/blobs/{gone}", content=content).status_code == 201
        assert c.post("/v1/snapshots", content=b.to_json()).status_code == 201
        assert _archive_blobs(c, b.id) == 40
    db = sqlite3.connect(data_dir / "meta.sqlite")
    assert [r[0] for r in db.execute("SELECT id FROM quarantine")] == [b.id]
    db.close()
    reliability.record(
        "half-published snapshot (references cut short) left by an older server: completed"
        " at start-up, or by publishing it again",
        tries=2,
        outcome="recovered",
        area="server killed",
    )
    reliability.record(
        "half-published snapshot whose blob is gone: quarantined at start-up (not listed),"
        " re-push publishes it",
        tries=1,
        outcome="recovered",
        area="server killed",
    )


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _drop_references(data_dir: Path, snapshot_id: str, *, keep: int) -> None:
    db = sqlite3.connect(data_dir / "meta.sqlite")
    with db:
        db.execute(
            "DELETE FROM snapshot_blobs WHERE snapshot_id = ? AND digest NOT IN"
            " (SELECT digest FROM snapshot_blobs WHERE snapshot_id = ? ORDER BY digest LIMIT ?)",
            [snapshot_id, snapshot_id, keep],
        )
    db.close()


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real 48 MiB tmpfs (root only: mounting needs it; skipped otherwise)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_nearly_full_disk_during_publish_answers_507_and_publishes_nothing(
    small_disk: Path, tmp_path: Path, reliability
) -> None:
    """A real full disk: the data dir is on a 48 MiB tmpfs, filled to 1 MiB of free space
    by a file of our own. The manifest (60,000 entries over 300 blobs, about 8 MB of JSON)
    needs more than that for its row, so SQLite's write fails with SQLITE_FULL."""
    server = ServerProcess(data_dir=small_disk / "data", home=tmp_path / "home")
    manifest = _stock(server.data_dir, blobs=300, files=60_000)
    body = manifest.to_json().encode()
    filler = small_disk / "filler"
    server.start()
    try:
        free = os.statvfs(small_disk)
        with open(filler, "wb") as fh:
            os.posix_fallocate(fh.fileno(), 0, free.f_bavail * free.f_frsize - (1 << 20))
        with httpx.Client(base_url=server.url, timeout=120) as c:
            answer = c.post("/v1/snapshots", content=body)
            assert answer.status_code == 507, answer.text[:300]
            assert answer.json()["error"] == "insufficient_storage"
            assert c.get("/v1/snapshots").json()["snapshots"] == []
            assert _references(server.data_dir, manifest.id) is None
            filler.unlink()  # space is back: the same publish succeeds
            assert c.post("/v1/snapshots", content=body).status_code == 201
            assert _archive_blobs(c, manifest.id) == 300
    finally:
        server.kill()
    reliability.record(
        "disk nearly full (a real 48 MiB tmpfs) during the publish of an 8 MB manifest:"
        " 507 insufficient_storage, nothing published",
        tries=1,
        outcome="refused",
        area="disk full",
    )
    reliability.record(
        "publish retried once space is back", tries=1, outcome="recovered", area="disk full"
    )
