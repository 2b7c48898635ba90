"""Where a restore reads a snapshot: the ``SnapshotSource`` protocol and the local sources.

``cachekeeper.restore.restore_snapshot`` owns the restore; a source only supplies the
manifest and a stream of the blobs still needed, as ``(digest, uncompressed bytes)``
pairs. Here: an archive file (``ArchiveFileSource``), an uncompressed tar stream
(``TarSource``), and a ``BlobSource`` such as the local blob store (``StoreSource``).
The server's source is ``cachekeeper.client.pull``'s, built on ``archive_blobs``, which
checks every archive member against the manifest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import zstandard

from cachekeeper.errors import (
    BlobMissing,
    CacheDirChanged,
    DigestMismatch,
    InvalidManifest,
    UnsafePath,
)
from cachekeeper.integrity import refuse_oversize
from cachekeeper.snapshot.archive import (
    MANIFEST_MEMBER,
    TarFormatError,
    TarMember,
    blob_digest,
    iter_tar,
    open_archive_stream,
)
from cachekeeper.snapshot.make import read_archive_manifest
from cachekeeper.snapshot.manifest import FileEntry, Manifest
from cachekeeper.snapshot.scan import CacheTree, ScannedFile

__all__ = [
    "Blobs",
    "BlobSource",
    "SnapshotSource",
    "archive_blobs",
    "StoreSource",
    "TarSource",
    "ArchiveFileSource",
    "DirSource",
]

# What a source hands the restore: ``(digest, uncompressed bytes)`` pairs, in any order.
Blobs = Iterable[tuple[str, BinaryIO]]


class BlobSource(Protocol):
    """Where restore reads blobs: ``open(digest)`` returns the uncompressed bytes."""

    def open(self, digest: str) -> BinaryIO: ...


class SnapshotSource(Protocol):
    """Where ``restore_snapshot`` reads one snapshot (archive file, blob store, server)."""

    @property
    def snapshot_id(self) -> str | None:
        """The snapshot's id when known before its manifest (a resolve), else None."""
        ...

    def manifest(self) -> Manifest:
        """The snapshot's manifest (the restore validates it and checks its signature)."""
        ...

    def open_blobs(
        self, needed: Mapping[str, Sequence[FileEntry]]
    ) -> AbstractContextManager[Blobs]:
        """A stream of the blobs ``needed`` (digest -> the entries using it) holds.

        Blobs outside ``needed`` may be in it (they are skipped); one that is missing is
        reported by the restore, naming its entry.
        """
        ...


def archive_blobs(manifest: Manifest, tar_stream: BinaryIO) -> Iterator[tuple[str, BinaryIO]]:
    """The blobs of an uncompressed snapshot tar stream (non-seekable is fine).

        A ``manifest.json`` member is skipped; any other member must be a regular
        ``blobs/<sha256>`` of ``manifest``, at most its declared size, and appear once. Its bytes
    are checked where they are written (the restore writer's ``BlobCheck``), not here.
    """
    declared = {e.digest: e for e in manifest.files}
    seen: set[str] = set()
    for member in _members(tar_stream):
        name = member.name
        if name in seen:
            raise InvalidManifest(f"archive member {name!r} appears twice")
        seen.add(name)
        if name == MANIFEST_MEMBER and member.isreg():
            continue
        if not member.isreg():
            raise UnsafePath(f"archive member {name!r} is not a regular file (link or device)")
        digest = blob_digest(name)
        if digest is None:
            raise UnsafePath(f"archive member {name!r} is not named blobs/<sha256>")
        entry = declared.get(digest)
        if entry is None:
            raise InvalidManifest(f"archive member {name!r} is not in the manifest")
        # Before a byte of it is read; the writer checks the bytes themselves.
        refuse_oversize(member.size, size_bytes=entry.size_bytes, digest=digest, path=entry.path)
        yield digest, member.stream  # type: ignore[misc]


def _members(stream: BinaryIO) -> Iterator[TarMember]:
    members = iter_tar(stream)
    while True:
        try:
            member = next(members)
        except StopIteration:
            return
        except (TarFormatError, zstandard.ZstdError) as exc:
            raise DigestMismatch(f"snapshot stream is corrupt: {exc}") from exc
        yield member


@dataclass(frozen=True)
class StoreSource:
    """A manifest whose blobs a ``BlobSource`` (a local blob store, a dir) opens one by one."""

    the_manifest: Manifest
    blobs: BlobSource
    snapshot_id: str | None = None

    def manifest(self) -> Manifest:
        return self.the_manifest

    @contextlib.contextmanager
    def open_blobs(self, needed: Mapping[str, Sequence[FileEntry]]) -> Iterator[Blobs]:
        yield self._each(needed)

    def _each(self, needed: Mapping[str, Sequence[FileEntry]]) -> Iterator[tuple[str, BinaryIO]]:
        for digest, entries in needed.items():
            try:
                stream = self.blobs.open(digest)
            except BlobMissing as exc:
                raise BlobMissing(
                    f"blob {digest} for {entries[0].path} is missing from the source",
                    extra={"missing": [digest], "path": entries[0].path},
                ) from exc
            with stream:
                yield digest, stream


@dataclass(frozen=True)
class TarSource:
    """A manifest and an uncompressed tar stream of its blobs (read once)."""

    the_manifest: Manifest
    tar_stream: BinaryIO
    snapshot_id: str | None = None

    def manifest(self) -> Manifest:
        return self.the_manifest

    def open_blobs(
        self, needed: Mapping[str, Sequence[FileEntry]]
    ) -> AbstractContextManager[Blobs]:
        return contextlib.nullcontext(archive_blobs(self.the_manifest, self.tar_stream))


@dataclass
class ArchiveFileSource:
    """A one-file archive (``snapshot.write_archive``): manifest first, then its blobs."""

    path: Path
    snapshot_id: str | None = None
    known_manifest: Manifest | None = None  # read once: by the caller, or on first use

    def manifest(self) -> Manifest:
        if self.known_manifest is None:
            self.known_manifest = read_archive_manifest(self.path)
        return self.known_manifest

    @contextlib.contextmanager
    def open_blobs(self, needed: Mapping[str, Sequence[FileEntry]]) -> Iterator[Blobs]:
        with open(self.path, "rb") as fh:
            stream = open_archive_stream(fh)
            try:
                yield archive_blobs(self.manifest(), stream)
            finally:
                stream.close()  # stops the read-ahead thread


class DirSource:
    """Blobs read from files of a scanned folder, by digest (``merge_tree``'s source),
    each opened through ``tree`` as the file the scan saw (``cachekeeper.snapshot.scan``)."""

    def __init__(self, tree: CacheTree, by_digest: dict[str, ScannedFile]) -> None:
        self.tree = tree
        self.by_digest = by_digest

    def open(self, digest: str) -> BinaryIO:
        try:
            return self.tree.open_scanned(self.by_digest[digest])
        except (KeyError, CacheDirChanged) as exc:
            raise BlobMissing(f"blob {digest} is gone from the source dir") from exc
