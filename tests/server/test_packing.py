"""pack_snapshot: publish-time checks of blobs in a real S3 API server (moto), the archive,
and concurrent publishes of one snapshot (a real server on loopback)."""

from __future__ import annotations

import io
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zstandard

from cachekeeper.backends.s3 import S3Backend, checksum_b64
from cachekeeper.errors import BlobMissing
from cachekeeper.restore import restore_archive
from cachekeeper.server import packing
from cachekeeper.server.packing import pack_snapshot
from cachekeeper.server.settings import Settings
from cachekeeper.snapshot.make import snapshot_dir, write_archive
from cachekeeper.snapshot.manifest import Manifest
from cachekeeper.store import LocalStore
from tests.helpers.live_server import start_server
from tests.helpers.metrics import sample
from tests.server.conftest import make_snapshot


def _snapshot(tmp_path: Path) -> tuple[Manifest, LocalStore]:
    src = tmp_path / "cache"
    (src / "fxgraph").mkdir(parents=True)
    (src / "fxgraph" / "small.py").write_bytes(b"print(1)\n" * 10)
    (src / "big.so").write_bytes(bytes(range(256)) * 2048)  # 512 KiB: spliced as a frame
    (src / "copy.so").write_bytes(bytes(range(256)) * 2048)  # same blob twice
    store = LocalStore(home=tmp_path / "home")
    manifest = snapshot_dir(src, store=store, workload="w", fingerprint={"torch": "x"})
    return manifest, store


def _upload(s3: S3Backend, store: LocalStore, digest: str, data: bytes | None = None) -> None:
    body = store.blobs.read(digest) if data is None else data
    url = s3.presigned_url(digest, method="PUT", expires_s=60)
    answer = httpx.put(url, content=body, headers={"x-amz-checksum-sha256": checksum_b64(digest)})
    assert answer.status_code == 200, answer.text


def test_pack_writes_an_archive_the_restore_reads(s3_bucket: str, tmp_path: Path) -> None:
    manifest, store = _snapshot(tmp_path)
    s3 = S3Backend.from_url(s3_bucket)
    for digest in manifest.digests:
        _upload(s3, store, digest)
    packed = pack_snapshot(s3, manifest, tmp_dir=tmp_path / "tmp")
    assert packed.sizes == {f.digest: f.size_bytes for f in manifest.files}
    archive = tmp_path / "got.tar.zst"
    archive.write_bytes(httpx.get(s3.archive_url(manifest.id, expires_s=60)).content)
    assert archive.stat().st_size == packed.archive_bytes
    restore_archive(archive, tmp_path / "out")
    assert (tmp_path / "out" / "big.so").read_bytes() == bytes(range(256)) * 2048
    assert (tmp_path / "out" / "fxgraph" / "small.py").read_bytes() == b"print(1)\n" * 10
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("kind", ["absent", "short", "corrupt-big", "corrupt-small"])
def test_pack_refuses_a_bad_object(s3_bucket: str, tmp_path: Path, kind: str) -> None:
    manifest, store = _snapshot(tmp_path)
    s3 = S3Backend.from_url(s3_bucket)
    by_size = sorted(manifest.files, key=lambda f: f.size_bytes)
    bad = by_size[0].digest if kind.endswith("small") else by_size[-1].digest
    for digest in manifest.digests:
        good = store.blobs.read(digest)
        if digest != bad:
            _upload(s3, store, digest)
        elif kind == "short":
            _upload(s3, store, digest, good[:-1])
        elif kind.startswith("corrupt"):
            _upload(s3, store, digest, bytes([good[0] ^ 1]) + good[1:])  # same size
    with pytest.raises(BlobMissing) as refused:
        pack_snapshot(s3, manifest, tmp_dir=tmp_path / "tmp")
    assert refused.value.extra["missing"] == [bad]
    assert bad in str(refused.value) or "1 blob(s)" in str(refused.value)
    assert not s3.has_archive(manifest.id)


def _tar(archive: bytes) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO(archive), read_across_frames=True
    )
    return reader.read()


def test_the_parallel_pack_writes_the_one_file_archives_tar(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blobs read by the pool (small ones, and framed ones) and a blob streamed through the
    multi-threaded compressor: the same tar, member for member, as ``snapshot`` writes."""
    monkeypatch.setattr(packing, "INLINE_MAX_BYTES", 256 << 10)  # big.so (512 KiB) streams
    monkeypatch.setattr(packing, "PREFETCH_BLOBS", 1)  # the writer waits on the pool
    manifest, store = _snapshot(tmp_path)
    s3 = S3Backend.from_url(s3_bucket)
    for digest in manifest.digests:
        _upload(s3, store, digest)
    pack_snapshot(s3, manifest, tmp_dir=tmp_path / "tmp", workers=2)
    packed = httpx.get(s3.archive_url(manifest.id, expires_s=60)).content
    one_file = tmp_path / "one.tar.zst"
    write_archive(manifest, store.blobs, one_file)
    assert _tar(packed) == _tar(one_file.read_bytes())


@pytest.mark.slow  # many concurrent publishes
def test_concurrent_publishes_of_one_snapshot_pack_it_once(s3_bucket: str, tmp_path: Path) -> None:
    """A client that timed out and published again while the first publish still packs:
    the second waits for the first (one pack, one archive object, no temp file left), and
    exactly one answer says ``created``."""
    rng = random.Random(13)
    files = {f"fxgraph/{i:03d}": rng.randbytes(rng.randint(1_000, 90_000)) for i in range(150)}
    manifest, blobs = make_snapshot(files)
    s3 = S3Backend.from_url(s3_bucket)
    data = tmp_path / "server"
    with start_server(Settings(data_dir=data, blob_store=s3_bucket)) as live:
        with httpx.Client(base_url=live.url, timeout=300) as client:
            answer = client.post("/v1/blobs/missing", json={"digests": sorted(blobs)}).json()
            for upload in answer["uploads"]:
                put = httpx.put(
                    upload["url"], content=blobs[upload["digest"]], headers=upload["headers"]
                )
                assert put.status_code == 200, put.text
            together = threading.Barrier(3)

            def publish(_: int) -> httpx.Response:
                together.wait(timeout=60)
                return client.post("/v1/snapshots", content=manifest.to_json())

            with ThreadPoolExecutor(max_workers=3) as pool:
                answers = list(pool.map(publish, range(3)))
            metrics = client.get("/metrics").text
        assert sorted(a.status_code for a in answers) == [200, 200, 201], [a.text for a in answers]
        assert [a.json()["created"] for a in answers].count(True) == 1
        assert sample(metrics, "cachekeeper_archive_packs_total") == 1
    assert list((data / "tmp").iterdir()) == []
    pending = s3.client.list_multipart_uploads(Bucket=s3.location.bucket)
    assert not pending.get("Uploads"), pending
    archive = tmp_path / "got.tar.zst"
    archive.write_bytes(httpx.get(s3.archive_url(manifest.id, expires_s=60)).content)
    restore_archive(archive, tmp_path / "out")
    for path, content in files.items():
        assert (tmp_path / "out" / path).read_bytes() == content
