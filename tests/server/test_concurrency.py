"""32 concurrent clients uploading, publishing, resolving and downloading at once."""

from __future__ import annotations

import hashlib
import io
import tarfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import zstandard

from tests.helpers.live_server import LiveServer
from tests.helpers.metrics import sample
from tests.server.conftest import FINGERPRINT, make_snapshot, push, random_files

CLIENTS = 32


def _worker(url: str, i: int) -> str:
    # every client shares one blob with the others, so uploads of the same digest race
    files = random_files(4, size=30_000, seed=100 + i, prefix=f"c{i}") | {"shared": b"s" * 70_000}
    manifest, blobs = make_snapshot(files, workload=f"conc-{i % 4}")
    with httpx.Client(base_url=url, timeout=60) as c:
        r = push(c, manifest, blobs)
        assert r.status_code in (200, 201), r.text
        res = c.post("/v1/resolve", json={"fingerprint": FINGERPRINT, "workload": f"conc-{i % 4}"})
        assert res.status_code == 200 and res.json()["snapshot"] is not None
        for digest, data in blobs.items():
            got = c.get(f"/v1/blobs/{digest}")
            assert got.status_code == 200 and got.content == data
        archive = c.get(f"/v1/snapshots/{manifest.id}/archive")
        raw = zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(archive.content), read_across_frames=True
        )
        with tarfile.open(fileobj=raw, mode="r|") as tar:
            for member in tar:
                if member.name.startswith("blobs/"):
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    assert hashlib.sha256(data).hexdigest() == member.name[6:]
    return manifest.id


@pytest.mark.slow  # 32 clients at once
def test_32_concurrent_clients(live: LiveServer) -> None:
    with ThreadPoolExecutor(CLIENTS) as pool:
        ids = list(pool.map(lambda i: _worker(live.url, i), range(CLIENTS)))
    assert len(set(ids)) == CLIENTS
    with httpx.Client(base_url=live.url) as c:
        listed = {s["id"] for s in c.get("/v1/snapshots").json()["snapshots"]}
        assert set(ids) <= listed
        assert sample(c.get("/metrics").text, "cachekeeper_archive_requests_total") == 32
    assert list((live.settings.data_dir / "blobs" / ".tmp").iterdir()) == []
