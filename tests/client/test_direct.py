"""client.direct against a real S3 API server (moto): ranged parallel GETs, refusals."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import zstandard

from cachekeeper.backends.s3 import S3Backend
from cachekeeper.client.direct import DirectUnavailable, ObjectStore


def _archive(s3_bucket: str, tmp_path: Path, data: bytes) -> str:
    s3 = S3Backend.from_url(s3_bucket)
    snapshot_id = hashlib.sha256(b"any").hexdigest()
    path = tmp_path / "a.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    s3.put_archive(snapshot_id, path)
    return s3.archive_url(snapshot_id, expires_s=60)


@pytest.mark.parametrize("part_bytes", [1000, 1 << 20])
def test_ranged_parallel_download_is_the_object(
    s3_bucket: str, tmp_path: Path, part_bytes: int
) -> None:
    data = hashlib.sha256(b"seed").digest() * 4000  # 128 KB that does not compress much
    url = _archive(s3_bucket, tmp_path, data)
    with ObjectStore() as objects:
        stream = objects.open_archive(url, part_bytes=part_bytes, parallel=3)
        try:
            assert stream.read() == data
        finally:
            stream.close()


def test_open_ranged_is_the_stored_object_not_decompressed(s3_bucket: str, tmp_path: Path) -> None:
    data = hashlib.sha256(b"seed").digest() * 4000
    url = _archive(s3_bucket, tmp_path, data)
    with ObjectStore() as objects:
        stream = objects.open_ranged(url, part_bytes=1000, parallel=3)
        try:
            assert stream.read() == (tmp_path / "a.zst").read_bytes()
        finally:
            stream.close()


def test_a_refused_url_raises_before_any_byte(s3_bucket: str, tmp_path: Path) -> None:
    url = _archive(s3_bucket, tmp_path, b"x" * 100)

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, text="<Error><Code>AccessDenied</Code></Error>")

    with ObjectStore(transport=httpx.MockTransport(refuse)) as objects:
        with pytest.raises(DirectUnavailable, match="HTTP 403.*expired"):
            objects.open_archive(url)
