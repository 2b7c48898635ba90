"""Publish into an object store: read every blob back, hash it, write the archive object.

With the S3 backend, nodes upload blobs straight to the store (presigned PUTs) and
download one archive object per snapshot (a presigned GET). The store may or may not have
checked a PUT's ``x-amz-checksum-sha256`` (moto does not), so the server checks here, at
publish, before any row names the snapshot: ``pack_snapshot`` builds the snapshot's archive
(the one format, ``cachekeeper.archive``, through ``server.archive.archive_chunks``) from the
blobs as the store holds them, hashing each one on the way, into a temp file, and uploads
it as ``archives/<id>.tar.zst``. A blob that is absent, of another size or of other bytes
refuses the publish (``BlobMissing`` naming it, so ``push`` uploads it again); nothing is
recorded. The caller records the rows afterwards, in one catalog transaction.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import zstandard

from cachekeeper.errors import BlobMissing, DigestMismatch
from cachekeeper.manifest import Manifest

from .archive import archive_chunks
from .s3store import S3BlobStore

__all__ = ["Packed", "pack_snapshot"]

_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class Packed:
    """A snapshot's archive object, written after every blob hashed right."""

    snapshot_id: str
    archive_bytes: int
    sizes: dict[str, int]  # digest -> uncompressed size, as hashed from the store


class _Hashing(io.RawIOBase):
    """A blob's bytes from the store, hashed as read; ``check()`` once they are all read."""

    def __init__(self, body: BinaryIO, digest: str, size_bytes: int) -> None:
        self._body = body
        self._digest = digest
        self._size_bytes = size_bytes
        self._hasher = hashlib.sha256()
        self._seen = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self._hasher.update(data)
        self._seen += n
        if self._seen > self._size_bytes:
            raise _corrupt(self._digest, f"it holds more than {self._size_bytes} bytes")
        return n

    def check(self) -> None:
        if self._seen != self._size_bytes:
            raise _corrupt(self._digest, f"it is {self._seen} bytes, not {self._size_bytes}")
        actual = self._hasher.hexdigest()
        if actual != self._digest:
            raise _corrupt(self._digest, f"its bytes hash to {actual}")

    def close(self) -> None:
        self._body.close()
        super().close()


def _corrupt(digest: str, why: str) -> BlobMissing:
    return BlobMissing(
        f"blob {digest} in the object store is not what the manifest names: {why}; upload it again",
        extra={"missing": [digest]},
    )


class _VerifyingSource:
    """The blob source ``archive_chunks`` reads, checking every blob it hands out."""

    def __init__(self, store: S3BlobStore, sizes: dict[str, int]) -> None:
        self._store = store
        self._sizes = sizes
        self._open: dict[str, _Hashing] = {}

    def _hashing(self, digest: str) -> _Hashing:
        reader = _Hashing(self._store.open(digest), digest, self._sizes[digest])
        self._open[digest] = reader
        return reader

    def open(self, digest: str) -> BinaryIO:
        """The whole (small) blob, already checked."""
        with self._hashing(digest) as reader:
            data = reader.read()
            reader.check()
        return io.BytesIO(data)

    def open_raw(self, digest: str) -> BinaryIO:
        """The blob as one zstd frame, compressed while read; checked in ``on_blob``."""
        reader = self._hashing(digest)
        frame = zstandard.ZstdCompressor(level=1).stream_reader(
            cast(BinaryIO, reader), size=self._sizes[digest], closefd=True
        )
        return frame  # type: ignore[return-value]

    def done(self, digest: str) -> None:
        reader = self._open.pop(digest, None)
        if reader is not None:
            reader.check()


def pack_snapshot(
    store: S3BlobStore, manifest: Manifest, *, tmp_dir: Path, level: int = 1
) -> Packed:
    """Check every blob of ``manifest`` in ``store`` and upload the snapshot's archive object.

    Raises ``BlobMissing`` (``missing``: the digests) for blobs absent, of the wrong size or
    whose bytes hash to something else; nothing is written to the store then.
    """
    sizes: dict[str, int] = {}
    for entry in manifest.files:
        sizes.setdefault(entry.digest, entry.size_bytes)
    absent = []
    for digest, size in sizes.items():
        found = store.stat(digest)
        if found is None or found.stored_bytes != size:
            absent.append(digest)
    if absent:
        raise BlobMissing(
            f"{len(absent)} blob(s) of snapshot {manifest.id[:12]} are absent from the object"
            " store or of the wrong size; upload them again",
            extra={"missing": sorted(absent)},
        )
    source = _VerifyingSource(store, sizes)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f"{manifest.id[:16]}.", suffix=".tar.zst", dir=tmp_dir)
    path = Path(name)
    try:
        with os.fdopen(handle, "wb") as out:
            for chunk in _chunks(manifest, sizes, source, level):
                out.write(chunk)
        archive_bytes = store.put_archive(manifest.id, path)
    finally:
        path.unlink(missing_ok=True)
    return Packed(manifest.id, archive_bytes, sizes)


def _chunks(
    manifest: Manifest, sizes: dict[str, int], source: _VerifyingSource, level: int
) -> Iterator[bytes]:
    try:
        yield from archive_chunks(
            manifest_json=manifest.to_json().encode(),
            blobs=list(sizes.items()),
            store=source,  # type: ignore[arg-type]
            level=level,
            on_blob=source.done,
        )
    except zstandard.ZstdError as exc:  # the store's bytes are not the size the frame declared
        raise DigestMismatch(f"a blob of snapshot {manifest.id[:12]} is corrupt: {exc}") from exc
