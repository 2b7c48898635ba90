"""The local directory backend: content-addressed blobs on local disk.

``LocalBackend`` is the server's default blob backend (``cachekeeper/backends/base.py``'s
``BlobBackend``; the registry opens it when no ``--blob-store`` URL is given) and the blob
folder of a node's local snapshot store (``cachekeeper.store``), which makes it directly.

Layout (``root`` is ``$CACHEKEEPER_HOME/blobs`` locally, ``<data>/blobs`` on the server)::

    root/
      ab/cd/abcd...64hex.zst    # one blob, zstd-compressed at rest, named by the sha256
      .tmp/                     # uploads in progress; never visible as blobs

Every ``put`` streams into a unique temp file under ``root/.tmp``, hashing the
uncompressed bytes as they arrive, refusing more bytes than declared, and only after the
digest matches (and an fsync) does ``os.replace`` make the blob visible. A crash at any
point leaves at most a temp file, which ``sweep_temp`` removes.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import zstandard

from cachekeeper.errors import BlobMissing, InsufficientStorage
from cachekeeper.integrity import CHUNK_BYTES, copy_verified, is_digest, require_digest

from .base import BlobStat, PutResult

__all__ = ["LocalBackend"]


class LocalBackend:
    """Blobs on a local filesystem, sharded by digest prefix, zstd at rest; no direct access."""

    def __init__(self, root: str | os.PathLike[str], *, level: int = 3) -> None:
        self.root = Path(root)
        self.level = level

    def path_for(self, digest: str) -> Path:
        require_digest(digest)
        return self.root / digest[:2] / digest[2:4] / f"{digest}.zst"

    def has(self, digest: str) -> bool:
        return self.path_for(digest).is_file()

    def stat(self, digest: str) -> BlobStat | None:
        """Size and modification time of the stored blob, or None when absent."""
        try:
            st = self.path_for(digest).stat()
        except FileNotFoundError:
            return None
        return BlobStat(digest=digest, stored_bytes=st.st_size, modified_at=st.st_mtime)

    def scan(self) -> Iterator[BlobStat]:
        """Every stored blob with its size and age (blobs deleted meanwhile are skipped)."""
        for digest in self.digests():
            found = self.stat(digest)
            if found is not None:
                yield found

    def direct_access(self) -> None:
        """A local directory has no URL of its own: nodes go through the server."""
        return None

    def size(self, digest: str) -> int | None:
        try:
            return self.path_for(digest).stat().st_size
        except FileNotFoundError:
            return None

    def open_raw(self, digest: str) -> BinaryIO:
        try:
            return open(self.path_for(digest), "rb")
        except FileNotFoundError as exc:
            raise BlobMissing(
                f"blob {digest} is not in the store", extra={"missing": [digest]}
            ) from exc

    def open(self, digest: str) -> BinaryIO:
        raw = self.open_raw(digest)
        return zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)  # type: ignore[return-value]

    def read(self, digest: str) -> bytes:
        with self.open(digest) as fh:
            return fh.read()

    def put(
        self, chunks: Iterable[bytes], *, digest: str, size_bytes: int | None = None
    ) -> PutResult:
        """Store the uncompressed bytes ``chunks`` under ``digest`` after checking them.

        Raises DigestMismatch (with both digests) or BlobTooLarge and stores nothing;
        raises InsufficientStorage when the disk is full.
        """
        final = self.path_for(digest)
        if final.is_file():
            for _ in chunks:  # drain the body so the connection stays usable
                pass
            return PutResult(digest, size_bytes or 0, final.stat().st_size, created=False)
        tmp_dir = self.root / ".tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = tmp_dir / f"{digest}.{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as out:
                writer = zstandard.ZstdCompressor(level=self.level).stream_writer(
                    out, closefd=False
                )
                total = copy_verified(chunks, writer.write, digest=digest, size_bytes=size_bytes)
                writer.flush(zstandard.FLUSH_FRAME)
                out.flush()
                os.fsync(out.fileno())
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
            return PutResult(digest, total, final.stat().st_size, created=True)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InsufficientStorage(f"no space left storing blob {digest}") from exc
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def put_file(self, path: str | os.PathLike[str], *, digest: str) -> PutResult:
        with open(path, "rb") as fh:
            return self.put(iter(lambda: fh.read(CHUNK_BYTES), b""), digest=digest)

    def delete(self, digest: str) -> bool:
        """Remove a blob; False when it is not there. Its shard folders are opened from
        the root's descriptor without following a link (GC deletes here): a shard swapped
        for a link deletes nothing elsewhere, and its blob counts as not there."""
        require_digest(digest)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            fd = os.open(self.root, flags)
        except FileNotFoundError:
            return False
        try:
            for shard in (digest[:2], digest[2:4]):
                child = os.open(shard, flags | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = child
            os.unlink(f"{digest}.zst", dir_fd=fd)
            return True
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                return False
            raise OSError(exc.errno, exc.strerror, str(self.path_for(digest))) from exc
        finally:
            os.close(fd)

    def digests(self) -> Iterator[str]:
        if not self.root.is_dir():
            return
        for shard in sorted(self.root.glob("??/??/*.zst")):
            name = shard.name[: -len(".zst")]
            if is_digest(name):
                yield name

    def sweep_temp(self, *, older_than_s: float = 3600.0) -> int:
        """Remove abandoned upload temp files; returns how many."""
        tmp_dir = self.root / ".tmp"
        if not tmp_dir.is_dir():
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        for entry in tmp_dir.iterdir():
            try:
                if entry.stat().st_mtime < cutoff:
                    if entry.is_dir():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed
