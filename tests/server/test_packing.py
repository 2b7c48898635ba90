"""pack_snapshot: publish-time checks of blobs in a real S3 API server (moto), and the archive."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from cachekeeper.server.packing import pack_snapshot
from cachekeeper.server.s3store import S3BlobStore, checksum_b64

from cachekeeper.errors import BlobMissing
from cachekeeper.manifest import Manifest
from cachekeeper.restore import restore_archive
from cachekeeper.snapshot import snapshot_dir
from cachekeeper.store import LocalStore


def _snapshot(tmp_path: Path) -> tuple[Manifest, LocalStore]:
    src = tmp_path / "cache"
    (src / "fxgraph").mkdir(parents=True)
    (src / "fxgraph" / "small.py").write_bytes(b"print(1)\n" * 10)
    (src / "big.so").write_bytes(bytes(range(256)) * 2048)  # 512 KiB: spliced as a frame
    (src / "copy.so").write_bytes(bytes(range(256)) * 2048)  # same blob twice
    store = LocalStore(home=tmp_path / "home")
    manifest = snapshot_dir(src, store=store, workload="w", fingerprint={"torch": "x"})
    return manifest, store


def _upload(s3: S3BlobStore, store: LocalStore, digest: str, data: bytes | None = None) -> None:
    body = store.blobs.read(digest) if data is None else data
    url = s3.presigned_url(digest, method="PUT", expires_s=60)
    answer = httpx.put(url, content=body, headers={"x-amz-checksum-sha256": checksum_b64(digest)})
    assert answer.status_code == 200, answer.text


def test_pack_writes_an_archive_the_restore_reads(s3_bucket: str, tmp_path: Path) -> None:
    manifest, store = _snapshot(tmp_path)
    s3 = S3BlobStore.from_url(s3_bucket)
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
    s3 = S3BlobStore.from_url(s3_bucket)
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
