"""cachekeeper/backends/base.py: one blob-backend interface; the server never asks which backend it holds.

The proof that a new backend is one new module: ``MemoryBlobs`` below (a real backend
holding real bytes in a dict, with the same integrity check every backend's ``put`` makes)
runs the whole snapshot path through the server's services (``server/services.py``): uploads, publish, resolve, the archive
stream, delete and GC. Then what direct access is, on the two backends that ship.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
import zstandard

from cachekeeper.backends.base import BlobBackend, BlobStat, PutResult
from cachekeeper.backends.local import LocalBackend
from cachekeeper.backends.registry import open_backend
from cachekeeper.backends.s3 import S3Backend
from cachekeeper.errors import BlobMissing, ConfigInvalid, DigestMismatch
from cachekeeper.integrity import copy_verified, digest_of, require_digest
from cachekeeper.server.catalog import Catalog
from cachekeeper.server.services import Services
from cachekeeper.server.settings import Settings
from cachekeeper.snapshot.archive import blob_digest, iter_tar, open_archive_stream
from tests.server.conftest import FINGERPRINT, make_snapshot, random_files


class MemoryBlobs:
    """A third backend, written against the protocol alone: blobs in a dict."""

    def __init__(self) -> None:
        self.blobs: dict[str, tuple[bytes, float]] = {}

    def put(
        self, chunks: Iterable[bytes], *, digest: str, size_bytes: int | None = None
    ) -> PutResult:
        require_digest(digest)
        if digest in self.blobs:
            return PutResult(digest, len(self.blobs[digest][0]), len(self.blobs[digest][0]), False)
        parts: list[bytes] = []
        total = copy_verified(chunks, parts.append, digest=digest, size_bytes=size_bytes)
        self.blobs[digest] = (b"".join(parts), time.time())
        return PutResult(digest, total, total, created=True)

    def open(self, digest: str) -> BinaryIO:
        if digest not in self.blobs:
            raise BlobMissing(f"blob {digest} is not in memory", extra={"missing": [digest]})
        return io.BytesIO(self.blobs[digest][0])

    def open_raw(self, digest: str) -> BinaryIO:
        with self.open(digest) as fh:
            return io.BytesIO(zstandard.ZstdCompressor().compress(fh.read()))

    def stat(self, digest: str) -> BlobStat | None:
        found = self.blobs.get(digest)
        return None if found is None else BlobStat(digest, len(found[0]), found[1])

    def delete(self, digest: str) -> bool:
        return self.blobs.pop(digest, None) is not None

    def scan(self) -> Iterator[BlobStat]:
        for digest in list(self.blobs):
            if (found := self.stat(digest)) is not None:
                yield found

    def direct_access(self) -> None:
        return None


def test_the_services_run_the_snapshot_path_on_a_backend_it_has_never_seen(tmp_path: Path) -> None:
    blobs: BlobBackend = MemoryBlobs()  # by its methods alone: it imports no other backend
    settings = Settings(data_dir=tmp_path / "data", gc_grace_s=0)
    services = Services.build(
        settings=settings, catalog=Catalog.create(tmp_path / "meta.sqlite"), backend=blobs
    )
    assert services.snapshots.direct is None
    manifest, contents = make_snapshot(random_files(5, size=3000, seed=7), verified=True)
    digest = next(iter(contents))
    with pytest.raises(DigestMismatch):  # the backend's own check, reached through the service
        services.blobs.put(digest, [b"other bytes"])
    for d, data in contents.items():
        assert services.blobs.put(d, [data]).created
    assert services.blobs.missing(contents) == [] and services.blobs.upload_targets(contents) == []
    summary, created = services.snapshots.publish(manifest)
    assert created and summary.id == manifest.id

    answer = services.resolver.resolve(fingerprint=FINGERPRINT, workload="wl")
    assert answer.snapshot is not None and answer.snapshot.id == manifest.id
    assert answer.archive_url is None  # no direct access: nodes download through the server

    stream = open_archive_stream(io.BytesIO(b"".join(services.snapshots.archive(manifest.id))))
    got = {blob_digest(m.name): m.stream.read() for m in iter_tar(stream) if blob_digest(m.name)}
    assert got == contents

    services.snapshots.delete(manifest.id)
    done = services.gc.execute(services.gc.plan())
    assert set(done.blobs) == set(contents) and done.bytes_freed == sum(map(len, contents.values()))
    assert list(blobs.scan()) == []


def test_direct_access_is_the_object_store_itself_and_none_for_a_directory(
    s3_bucket: str, tmp_path: Path
) -> None:
    assert LocalBackend(tmp_path / "blobs").direct_access() is None
    store = S3Backend.from_url(s3_bucket)
    direct = store.direct_access()
    assert direct is store
    data = b"uploaded by a node " * 100
    digest = digest_of(data)
    target = direct.upload_target(digest, expires_s=60)
    assert target.digest == digest
    answer = httpx.put(target.url, content=data, headers=target.headers)
    assert answer.status_code == 200, answer.text
    found = store.stat(digest)
    assert found is not None and found.stored_bytes == len(data)


def test_open_backend_picks_by_scheme(s3_bucket: str, tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    (root / ".tmp").mkdir(parents=True)
    stale = root / ".tmp" / "abandoned-upload"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - 10, time.time() - 10))
    local = open_backend(None, local_root=root)
    assert isinstance(local, LocalBackend) and not stale.exists()  # swept at start
    assert isinstance(open_backend(s3_bucket, local_root=root), S3Backend)
    with pytest.raises(ConfigInvalid, match="'gs://bucket/p': no backend for gs://"):
        open_backend("gs://bucket/p", local_root=root)
