"""S3Backend against a real S3 API server (moto) on loopback."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import zstandard

from cachekeeper.backends.local import LocalBackend
from cachekeeper.backends.s3 import S3Backend, checksum_b64, parse_s3_url
from cachekeeper.errors import BlobMissing, BlobTooLarge, ConfigInvalid, DigestMismatch


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://bucket/a/b/").prefix == "a/b/"
    assert parse_s3_url("s3://bucket").prefix == ""
    with pytest.raises(ConfigInvalid, match="not s3://BUCKET/PREFIX"):
        parse_s3_url("/data/blobs")


def test_put_stat_open_delete(s3_bucket: str) -> None:
    store = S3Backend.from_url(s3_bucket)
    data = b"kernel " * 10_000
    digest = _digest(data)
    assert store.stat(digest) is None
    made = store.put([data[:100], data[100:]], digest=digest)
    assert made.created and made.size_bytes == len(data)
    again = store.put([data], digest=digest)
    assert not again.created
    assert store.stat(digest).stored_bytes == len(data)  # type: ignore[union-attr]
    with store.open(digest) as fh:
        assert fh.read() == data
    with store.open_raw(digest) as raw:
        frame = raw.read()
    assert zstandard.ZstdDecompressor().decompress(frame) == data
    assert [s.digest for s in store.scan()] == [digest]
    assert store.delete(digest) and not store.delete(digest)
    with pytest.raises(BlobMissing):
        store.open(digest)


def test_put_refuses_wrong_bytes(s3_bucket: str) -> None:
    store = S3Backend.from_url(s3_bucket)
    with pytest.raises(DigestMismatch):
        store.put([b"other bytes"], digest=_digest(b"these bytes"))
    assert list(store.scan()) == []


def test_presigned_put_then_get_with_range(s3_bucket: str) -> None:
    store = S3Backend.from_url(s3_bucket)
    data = bytes(range(256)) * 64
    digest = _digest(data)
    url = store.presigned_url(digest, method="PUT", expires_s=60)
    answer = httpx.put(url, content=data, headers={"x-amz-checksum-sha256": checksum_b64(digest)})
    assert answer.status_code == 200, answer.text
    got = httpx.get(store.presigned_url(digest), headers={"Range": "bytes=10-19"})
    assert got.status_code == 206 and got.content == data[10:20]


def test_archive_object(s3_bucket: str, tmp_path: Path) -> None:
    store = S3Backend.from_url(s3_bucket)
    snapshot_id = _digest(b"snapshot")
    path = tmp_path / "a.tar.zst"
    path.write_bytes(b"archive bytes")
    size, etag = store.put_archive(snapshot_id, path)
    assert size == len(b"archive bytes") and etag and store.archive_etag(snapshot_id) == etag
    assert httpx.get(store.archive_url(snapshot_id, expires_s=60)).content == b"archive bytes"
    assert [a.digest for a in store.archives()] == [snapshot_id]
    assert store.delete_archive(snapshot_id) and not store.has_archive(snapshot_id)


def test_archive_url_is_shared_for_a_third_of_its_life(s3_bucket: str, tmp_path: Path) -> None:
    """A herd resolving one snapshot costs one signature, and no node gets a URL that
    expires sooner than 2/3 of the configured life (the reuse window is a third)."""
    store = S3Backend.from_url(s3_bucket)
    snapshot_id = _digest(b"shared")
    path = tmp_path / "a.tar.zst"
    path.write_bytes(b"archive bytes")
    store.put_archive(snapshot_id, path)
    first = store.archive_url(snapshot_id, expires_s=600)
    assert store.archive_url(snapshot_id, expires_s=600) == first
    assert "X-Amz-Expires=600" in first
    assert httpx.get(first).content == b"archive bytes"
    signed_at = store._archive_urls[snapshot_id][1]
    store._archive_urls[snapshot_id] = (first, signed_at - 201)  # a third of 600 s ago
    assert "X-Amz-Expires=600" in store.archive_url(snapshot_id, expires_s=600)
    assert store._archive_urls[snapshot_id][1] > signed_at - 201  # signed again
    store.delete_archive(snapshot_id)
    assert snapshot_id not in store._archive_urls


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.parametrize(
    ("chunks", "declared", "error"),
    [
        ([b"these ", b"bytes", b"!"], 11, BlobTooLarge),  # more than declared: stops early
        ([b"these ", b"byte"], 11, DigestMismatch),  # fewer (and so other) bytes
        ([b"these bytes"], 12, DigestMismatch),  # the right bytes, but not the declared size
    ],
)
def test_both_backends_refuse_the_same_puts(
    backend: str,
    chunks: list[bytes],
    declared: int,
    error: type[Exception],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """One check (integrity.copy_verified) for the local dir and the object store: a body
    over or under its declared size, or hashing to another digest, stores nothing."""
    store: LocalBackend | S3Backend = (
        S3Backend.from_url(request.getfixturevalue("s3_bucket"))
        if backend == "s3"
        else LocalBackend(tmp_path / "blobs")
    )
    digest = _digest(b"these bytes")
    with pytest.raises(error):
        store.put(iter(chunks), digest=digest, size_bytes=declared)
    assert store.stat(digest) is None and list(store.scan()) == []
