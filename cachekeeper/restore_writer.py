"""Restore's writer: verified staging files that appear in the cache dir without clobbering.

See ``cachekeeper.restore`` for the rules; this module holds the mechanics: the staging
folder ``CACHE_DIR/.cachekeeper/staging/<host>-<pid>-<rand>/``, hashing and size checks,
a thread pool for small blobs, per-file ``sync_file_range`` before publication, and an
atomic no-clobber rename (``renameat2``, else ``os.link``) to publish.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import shutil
import socket
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from cachekeeper._proc import pid_alive
from cachekeeper.blobstore import CHUNK_BYTES
from cachekeeper.errors import BlobTooLarge, DigestMismatch
from cachekeeper.manifest import FileEntry, Manifest
from cachekeeper.snapshot import hash_file
from cachekeeper.triton_groups import is_group_path, looks_rewritten, rewrite_group

__all__ = ["Writer", "is_present", "STATE_DIR"]

STATE_DIR = ".cachekeeper"
_BATCH_BYTES = 128 << 20
_BATCH_FILES = 1024
_POOLED_BYTES = 4 << 20  # blobs up to this size are hashed and written by a thread pool
_MAX_IN_FLIGHT = 64
_STAGING_RE = re.compile(r"^(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")

Progress = Callable[[int], None]


def is_present(entry: FileEntry, final: Path, paths: set[str], root: Path) -> bool | None:
    """True: same file there; False: a different thing there (conflict); None: absent."""
    try:
        st = final.lstat()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return False
    if not final.is_file() or final.is_symlink():
        return False
    if st.st_size == entry.size_bytes and hash_file(final)[0] == entry.digest:
        return True
    if is_group_path(entry.path) and st.st_size < (16 << 20):
        return looks_rewritten(final.read_bytes(), paths=paths, root=root)
    return False


# -- staging and writing -----------------------------------------------------------------


def _sweep_stale_staging(staging_root: Path) -> None:
    """Remove staging folders of dead restores on this host (only names we create)."""
    if not staging_root.is_dir():
        return
    host = socket.gethostname()
    for child in staging_root.iterdir():
        found = _STAGING_RE.match(child.name)
        if not found or found["host"] != host or not child.is_dir() or child.is_symlink():
            continue
        if not pid_alive(int(found["pid"])):
            shutil.rmtree(child, ignore_errors=True)


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sync_file_range.argtypes = [
            ctypes.c_int,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_uint,
        ]
        return libc
    except (OSError, AttributeError):
        return None


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _rename_noreplace(src: Path, dst: Path) -> bool | None:
    """Atomically rename ``src`` to ``dst`` unless ``dst`` exists (Linux renameat2).

    True: renamed. False: ``dst`` exists (nothing changed). None: not supported here
    (old kernel or libc, or a filesystem without RENAME_NOREPLACE): use link instead.
    """
    libc = _libc()
    fn = getattr(libc, "renameat2", None) if libc is not None else None
    if fn is None:
        return None
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return None
    raise OSError(err, os.strerror(err), str(dst))


_SYNC_FILE_RANGE_ALL = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER


def _settle(fd: int) -> None:
    """Write this file's data to the device before it can appear under its final name.

    ``sync_file_range`` writes back this file's pages (allocating its blocks) and waits,
    without forcing a journal commit and without touching other processes' dirty data
    (``syncfs`` would flush the whole filesystem, so a node busy writing a checkpoint
    would hold the job's start hostage). The rename that publishes the file lands in the
    same or a later journal transaction than the allocation, and a commit flushes the
    device cache before it is written, so after a crash a file that is visible is
    complete. Where sync_file_range is missing, ``fdatasync``.
    """
    libc = _libc()
    if libc is not None and libc.sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_ALL) == 0:
        return
    os.fdatasync(fd)


def _write_settled(path: Path, data: bytes) -> None:
    with open(path, "wb", buffering=0) as out:
        out.write(data)
        _settle(out.fileno())


class Writer:
    """Writes verified blobs into staging, then makes them appear in the cache dir."""

    def __init__(
        self, manifest: Manifest, cache_dir: Path, progress: Progress | None, *, hold: bool = False
    ) -> None:
        """``hold``: publish nothing before the final ``flush`` (all-or-nothing restores)."""
        self.cache_dir = cache_dir
        self.hold = hold
        self.paths = {e.path for e in manifest.files}
        self.progress = progress
        staging_root = cache_dir / STATE_DIR / "staging"
        _sweep_stale_staging(staging_root)
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.staging = staging_root / name
        self.staging.mkdir(parents=True)
        self.pending: list[tuple[Path, FileEntry]] = []
        self.pending_bytes = 0
        self.written = 0
        self.bytes_written = 0
        self.skipped = 0
        self.conflicts: list[str] = []
        self._made_dirs: set[Path] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2))
        self._futures: deque[Future[None]] = deque()
        self._noreplace = True  # renameat2(RENAME_NOREPLACE) until it proves unsupported
        # One publisher thread: a batch is flushed to disk and linked into place while the
        # main thread decompresses and writes the next one (at most one batch in flight).
        self._publisher = ThreadPoolExecutor(max_workers=1)
        self._publishing: Future[None] | None = None

    def _tmp(self) -> Path:
        return self.staging / uuid.uuid4().hex

    def write_blob(self, digest: str, stream: BinaryIO, entries: list[FileEntry]) -> None:
        """Read one blob, verify it in staging, and queue every entry that uses it.

        Small blobs are read here and hashed/written by the thread pool (file creation is
        the slow part of restoring thousands of small files); large ones stream here.
        """
        first = entries[0]
        declared = first.size_bytes
        if declared <= _POOLED_BYTES:
            parts, total = [], 0
            while chunk := stream.read(min(CHUNK_BYTES, declared - total + 1)):
                total += len(chunk)
                if total > declared:
                    raise self._too_large(digest, first)
                parts.append(chunk)
            self._futures.append(self._pool.submit(self._store, digest, b"".join(parts), entries))
            if len(self._futures) > _MAX_IN_FLIGHT:
                self._futures.popleft().result()
        else:
            tmp = self._tmp()
            hasher = hashlib.sha256()
            total = 0
            with open(tmp, "wb", buffering=0) as out:
                while chunk := stream.read(min(CHUNK_BYTES, declared - total + 1)):
                    total += len(chunk)
                    if total > declared:
                        raise self._too_large(digest, first)
                    hasher.update(chunk)
                    out.write(chunk)
                _settle(out.fileno())
            self._check(digest, first, total, hasher.hexdigest())
            self._queue(tmp, entries)
        if self.hold:
            return
        if self.pending_bytes >= _BATCH_BYTES or len(self.pending) >= _BATCH_FILES:
            error = self._drain()
            if error is not None:
                raise error
            self._flush_async()

    @staticmethod
    def _too_large(digest: str, entry: FileEntry) -> BlobTooLarge:
        return BlobTooLarge(
            f"blob {digest} for {entry.path} is larger than its declared {entry.size_bytes} bytes"
        )

    @staticmethod
    def _check(digest: str, entry: FileEntry, total: int, actual: str) -> None:
        if total != entry.size_bytes or actual != digest:
            raise DigestMismatch(
                f"blob for {entry.path} is corrupt: {total} bytes hashing to {actual}, "
                f"expected {entry.size_bytes} bytes hashing to {digest}",
                extra={"path": entry.path, "expected": digest, "actual": actual},
            )

    def _store(self, digest: str, data: bytes, entries: list[FileEntry]) -> None:
        """(pool thread) Verify a small blob's bytes, write them to staging, queue them."""
        self._check(digest, entries[0], len(data), hashlib.sha256(data).hexdigest())
        tmp = self._tmp()
        with open(tmp, "wb", buffering=0) as out:
            out.write(data)
            _settle(out.fileno())
        self._queue(tmp, entries)

    def _queue(self, tmp: Path, entries: list[FileEntry]) -> None:
        """Queue a verified staging file for every entry that uses it."""
        queued: list[tuple[Path, FileEntry]] = []
        tmp_used = False
        for i, entry in enumerate(entries):
            parent = (self.cache_dir / entry.path).parent
            if parent not in self._made_dirs:  # folders early, off the publishing thread
                with contextlib.suppress(FileExistsError, NotADirectoryError):
                    parent.mkdir(parents=True, exist_ok=True)
                    self._made_dirs.add(parent)
            if is_group_path(entry.path):
                data = rewrite_group(tmp.read_bytes(), paths=self.paths, root=self.cache_dir)
                target = self._tmp()
                _write_settled(target, data)
            elif i == len(entries) - 1:
                target, tmp_used = tmp, True
            else:
                target = self._tmp()
                _write_settled(target, tmp.read_bytes())
            queued.append((target, entry))
        if not tmp_used:
            tmp.unlink()
        with self._lock:
            self.pending.extend(queued)
            self.pending_bytes += sum(e.size_bytes for _, e in queued)

    def _drain(self) -> BaseException | None:
        """Wait for every pooled write; return the first error (the rest are queued)."""
        error: BaseException | None = None
        while self._futures:
            exc = self._futures.popleft().exception()
            if exc is not None and error is None:
                error = exc
        return error

    def flush(self) -> None:
        """Make queued (verified) files durable, then visible; re-raise a pooled error.

        Returns once everything queued so far is published (or refused as a conflict).
        """
        error = self._drain()
        if error is not None and self.hold:
            self._wait_publishing()
            raise error  # all-or-nothing: a failed blob publishes nothing
        self._flush_async()
        self._wait_publishing()
        if error is not None:
            raise error

    def _flush_async(self) -> None:
        """Hand the verified files queued so far to the publisher thread."""
        self._wait_publishing()  # one batch in flight: bounded staging, ordered publication
        with self._lock:
            batch, batch_bytes = self.pending, self.pending_bytes
            self.pending, self.pending_bytes = [], 0
        if batch:
            self._publishing = self._publisher.submit(self._publish_batch, batch, batch_bytes)

    def _wait_publishing(self) -> None:
        if self._publishing is not None:
            future, self._publishing = self._publishing, None
            future.result()

    def _publish_batch(self, batch: list[tuple[Path, FileEntry]], batch_bytes: int) -> None:
        """(publisher thread) Move a batch of verified, settled files into place."""
        for tmp, entry in batch:
            self._publish(tmp, entry)
        if self.progress is not None:
            self.progress(batch_bytes)

    def _publish(self, tmp: Path, entry: FileEntry) -> None:
        final = self.cache_dir / entry.path
        renamed: bool | None = None
        try:
            os.chmod(tmp, entry.mode)
            if final.parent not in self._made_dirs:
                try:
                    final.parent.mkdir(parents=True, exist_ok=True)
                except (FileExistsError, NotADirectoryError):
                    self.conflicts.append(entry.path)
                    return
                self._made_dirs.add(final.parent)
            renamed = _rename_noreplace(tmp, final) if self._noreplace else None
            if renamed is False:
                self._classify_existing(entry, final)
                return
            if renamed is None:
                self._noreplace = False
                self._link_into_place(tmp, final, entry)
                return
            self.written += 1
            self.bytes_written += entry.size_bytes
        finally:
            if not renamed:  # renamed: the staging name is gone already
                tmp.unlink(missing_ok=True)

    def _link_into_place(self, tmp: Path, final: Path, entry: FileEntry) -> None:
        """The portable path: hard link (fails if ``final`` exists), else check + replace."""
        try:
            os.link(tmp, final)
        except FileExistsError:
            self._classify_existing(entry, final)
            return
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if os.path.lexists(final):  # no hard links here: check, then replace
                self._classify_existing(entry, final)
                return
            os.replace(tmp, final)
        self.written += 1
        self.bytes_written += entry.size_bytes

    def _classify_existing(self, entry: FileEntry, final: Path) -> None:
        if is_present(entry, final, self.paths, self.cache_dir):
            self.skipped += 1
        else:
            self.conflicts.append(entry.path)

    def close(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)
        with contextlib.suppress(Exception):  # an error here was raised by flush already
            self._wait_publishing()
        self._publisher.shutdown(wait=True)
        shutil.rmtree(self.staging, ignore_errors=True)
