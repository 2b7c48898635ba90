"""Publish into an object store: read every blob back, hash it, write the archive object.

With a backend nodes reach directly (``cachekeeper/backends/base.py``'s ``DirectAccess``: the S3
one), nodes upload blobs straight to the store (presigned PUTs) and download one archive
object per snapshot (a presigned GET). The store may or may not have
checked a PUT's ``x-amz-checksum-sha256`` (moto does not), so the server checks here, at
publish, before any row names the snapshot: ``pack_snapshot`` builds the snapshot's archive
(the one format, ``cachekeeper.snapshot.archive``, through ``server.archive.archive_chunks``) from the
blobs as the store holds them, each read through the integrity check
(``cachekeeper.integrity.HashingReader``), into a temp file, and uploads
it as ``archives/<id>.tar.zst``. A blob that is absent, of another size or of other bytes
refuses the publish (``BlobMissing`` naming every such blob, so ``push`` uploads them
again); nothing is recorded. A blob object holding other bytes than its name says (changed
behind the server's back) is removed then, so that ``blobs/missing`` reports it and the
push's upload replaces it; otherwise every re-push would fail on it again. The caller
(``Snapshots.publish``, ``server/resources/snapshots.py``) records the rows afterwards, in
one catalog transaction, with the archive object's ETag (``archive_objects``): a re-push
finds an archive object changed since by its ETag and packs it again. This module holds
no SQL.

Speed. A snapshot is thousands of blobs, mostly small, and each costs the store a request
(tens of ms of latency), so the blobs are read by a small bounded thread pool
(``PACK_WORKERS``) at most ``PREFETCH_BYTES`` ahead of the writer, which still takes them in
manifest order: the archive's members and their order are those of
``cachekeeper.snapshot.archive.layout``, unchanged. A worker reads one whole blob (up to
``INLINE_MAX_BYTES``), hashes it and, when the archive splices it as its own zstd frame,
compresses that frame too (hashlib and zstandard release the GIL, so this runs in
parallel). A larger blob is streamed by the writer itself, hashed as read, and compressed
by zstandard's multi-threaded compressor: its output is one ordinary zstd frame, read by
the same decoder. Each blob costs one GET; only a publish that fails looks every blob up
(HEAD) to name all the absent ones at once.

Concurrency. ``Snapshots.publish`` holds ``SnapshotLocks`` for the snapshot's id, so a
client that timed out and published again waits for the pack in progress and then finds
the snapshot published, instead of packing it a second time. Without that lock (several
server processes) two packs are still harmless: each writes its own temp file
(``mkstemp``) and the store replaces the archive object whole on each upload.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import zstandard

from cachekeeper.backends.base import DirectAccess
from cachekeeper.errors import BlobMissing, DigestMismatch
from cachekeeper.integrity import HashingReader
from cachekeeper.snapshot.manifest import Manifest

from .archive import SPLICE_MIN_BYTES, archive_chunks

__all__ = [
    "INLINE_MAX_BYTES",
    "PACK_WORKERS",
    "PREFETCH_BYTES",
    "Packed",
    "SnapshotLocks",
    "pack_snapshot",
]

PACK_WORKERS = 8  # blob reads in flight per publish (I/O bound: the store's latency)
PREFETCH_BYTES = 64 << 20  # blob bytes read ahead of the archive writer, at most
PREFETCH_BLOBS = 256  # and at most this many blobs
INLINE_MAX_BYTES = 16 << 20  # larger blobs are streamed by the writer, not held in memory
FRAME_LEVEL = 1  # a spliced blob's zstd frame (as ``S3Backend.open_raw``)
FRAME_THREADS = 4  # zstd workers for one streamed large blob


@dataclass(frozen=True)
class Packed:
    """A snapshot's archive object, written after every blob hashed right."""

    snapshot_id: str
    archive_bytes: int
    sizes: dict[str, int]  # digest -> uncompressed size, as hashed from the store
    modified_at: dict[str, float]  # digest -> its object's last-modified time, as read
    archive_etag: str = ""  # the archive object's ETag right after the upload


class SnapshotLocks:
    """One lock per snapshot id, held while that snapshot is published (see module doc)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, snapshot_id: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._held.get(snapshot_id, (threading.Lock(), 0))
            self._held[snapshot_id] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._held[snapshot_id]
                if users == 1:
                    del self._held[snapshot_id]
                else:
                    self._held[snapshot_id] = (lock, users - 1)


def _checked(body: BinaryIO, digest: str, size_bytes: int) -> HashingReader:
    """A blob's bytes from the store through the integrity check; a failure is ``_corrupt``."""
    return HashingReader(
        body,
        digest=digest,
        size_bytes=size_bytes,
        name=f"blob {digest} in the object store",
        refuse=lambda exc: _corrupt(digest, exc),
    )


def _corrupt(digest: str, exc: DigestMismatch) -> BlobMissing:
    """The blob's object holds other bytes: ``corrupt`` names it, so the publish removes the
    object and the push's next ``blobs/missing`` asks for it again (``Blobs.missing``)."""
    return BlobMissing(
        f"{exc.detail}; upload it again", extra={"missing": [digest], "corrupt": [digest]}
    )


def _fetch(store: DirectAccess, digest: str, size_bytes: int) -> tuple[bytes, float]:
    """One whole blob from the store, checked (as its zstd frame when the archive splices
    it), and its object's last-modified time."""
    body, modified_at = store.open_dated(digest)
    with _checked(body, digest, size_bytes) as reader:
        data = reader.read(size_bytes + 1)  # one byte more: an overlong object fails check
        reader.check()
    if size_bytes >= SPLICE_MIN_BYTES:
        data = zstandard.ZstdCompressor(level=FRAME_LEVEL).compress(data)
    return data, modified_at


class _PrefetchingSource:
    """The blob source ``archive_chunks`` reads, in manifest order, checking every blob.

    Blobs up to ``INLINE_MAX_BYTES`` are fetched by ``pool`` ahead of the writer (at most
    ``PREFETCH_BYTES`` of them unread); larger ones are streamed when the writer gets there.
    """

    def __init__(
        self, store: DirectAccess, sizes: dict[str, int], pool: ThreadPoolExecutor
    ) -> None:
        self._store = store
        self._sizes = sizes
        self._pool = pool
        self._order = deque(d for d, n in sizes.items() if n <= INLINE_MAX_BYTES)
        self._fetched: dict[str, Future[tuple[bytes, float]]] = {}
        self.modified_at: dict[str, float] = {}
        self._ahead_bytes = 0
        self._streaming: dict[str, HashingReader] = {}
        self._fill()

    def _fill(self) -> None:
        while self._order and (
            not self._fetched
            or (self._ahead_bytes < PREFETCH_BYTES and len(self._fetched) < PREFETCH_BLOBS)
        ):
            digest = self._order.popleft()
            size = self._sizes[digest]
            self._fetched[digest] = self._pool.submit(_fetch, self._store, digest, size)
            self._ahead_bytes += size

    def _take(self, digest: str) -> bytes:
        future = self._fetched.pop(digest)
        self._ahead_bytes -= self._sizes[digest]
        self._fill()
        data, self.modified_at[digest] = future.result()
        return data

    def open(self, digest: str) -> BinaryIO:
        """The whole (small) blob, already checked."""
        return io.BytesIO(self._take(digest))

    def open_raw(self, digest: str) -> BinaryIO:
        """The blob as one zstd frame; a large one is compressed while read, checked in
        ``done``."""
        if digest in self._fetched:
            return io.BytesIO(self._take(digest))
        body, self.modified_at[digest] = self._store.open_dated(digest)
        reader = _checked(body, digest, self._sizes[digest])
        self._streaming[digest] = reader
        frame = zstandard.ZstdCompressor(level=FRAME_LEVEL, threads=FRAME_THREADS).stream_reader(
            cast(BinaryIO, reader), size=self._sizes[digest], closefd=True
        )
        return frame  # type: ignore[return-value]

    def done(self, digest: str) -> None:
        if digest in self._fetched:  # an empty blob: the archive writer reads no bytes of it
            self._take(digest)
        reader = self._streaming.pop(digest, None)
        if reader is not None:
            reader.check()

    def cancel(self) -> None:
        for future in self._fetched.values():
            future.cancel()


def pack_snapshot(
    store: DirectAccess,
    manifest: Manifest,
    *,
    tmp_dir: Path,
    level: int = 1,
    workers: int = PACK_WORKERS,
) -> Packed:
    """Check every blob of ``manifest`` in ``store`` and upload the snapshot's archive object.

    Raises ``BlobMissing`` (``missing``: the digests) for blobs absent, of the wrong size or
    whose bytes hash to something else; nothing is written to the store then.
    """
    sizes: dict[str, int] = {}
    for entry in manifest.files:
        sizes.setdefault(entry.digest, entry.size_bytes)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f"{manifest.id[:16]}.", suffix=".tar.zst", dir=tmp_dir)
    path = Path(name)
    try:
        with (
            os.fdopen(handle, "wb") as out,
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ck-pack") as pool,
        ):
            source = _PrefetchingSource(store, sizes, pool)
            try:
                for chunk in _chunks(manifest, sizes, source, level):
                    out.write(chunk)
            except BlobMissing as exc:
                source.cancel()
                failed = _all_missing(store, sizes, manifest, exc)
                for digest in failed.extra.pop("corrupt", []):
                    store.delete(digest)  # other bytes under its name: the push sends it again
                raise failed from exc
            except BaseException:
                source.cancel()
                raise
        archive_bytes, etag = store.put_archive(manifest.id, path)
    finally:
        path.unlink(missing_ok=True)
    return Packed(manifest.id, archive_bytes, sizes, source.modified_at, archive_etag=etag)


def _all_missing(
    store: DirectAccess, sizes: dict[str, int], manifest: Manifest, first: BlobMissing
) -> BlobMissing:
    """``first`` (a blob that failed) with every other blob absent or of the wrong size."""
    found = store.stat_many(sizes)
    absent = {d for d, stat in found.items() if stat is None or stat.stored_bytes != sizes[d]}
    named = set(first.extra.get("missing", []))
    if absent <= named:
        return first
    return BlobMissing(
        f"{len(absent | named)} blob(s) of snapshot {manifest.id[:12]} are absent from the"
        " object store, of the wrong size or of other bytes; upload them again",
        extra={"missing": sorted(absent | named), "corrupt": first.extra.get("corrupt", [])},
    )


def _chunks(
    manifest: Manifest, sizes: dict[str, int], source: _PrefetchingSource, level: int
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
