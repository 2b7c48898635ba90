"""Restore's writer: verified staging files that appear in the cache dir without clobbering.

See ``cachekeeper.restore`` for the rules; this module holds the mechanics: the staging
folder ``CACHE_DIR/.cachekeeper/staging/<host>-<pid>-<rand>/``, the integrity check of every
blob (``cachekeeper.integrity``: its size as it is read, then its length and hash),
a thread pool for small blobs, per-file ``sync_file_range`` before publication, and an
atomic no-clobber rename (``renameat2``, else ``os.link``) to publish.

**No write through a link it did not create.** Folders under the cache dir are opened
one component at a time from a descriptor of the cache dir, with ``O_NOFOLLOW |
O_DIRECTORY`` (``_Folders``), and made with ``mkdirat``, which does not follow a link
either; a file appears by ``renameat2`` into the descriptor of its folder. A link (or a
file) where a folder should be makes every file below it a conflict, at any depth, and
swapping a folder for a link mid-restore cannot redirect a write. The planner checks
the same with ``lstat`` (``links_above``), so a dry run and the report agree. The cache
dir itself may be a link: the caller named it. The staging folder is reached the same way,
through descriptors (``marker.StateDir``), so a link in ``.cachekeeper/`` is never followed.

**Modes.** A file appears with the manifest's mode less group and other write
(``SAFE_MODE_MASK``), and the folders it makes are ``0o755``: whatever a snapshot says, no
other local user can rewrite a restored kernel that the next job would load.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import socket
import stat
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO

from cachekeeper._proc import pid_alive
from cachekeeper.daemon_pool import DaemonPool
from cachekeeper.integrity import CHUNK_BYTES, BlobCheck, hash_file, refuse_oversize, verify_bytes
from cachekeeper.restore.marker import FOLDER_MODE, STATE_DIR, StateDir
from cachekeeper.restore.triton_groups import is_group_path, looks_rewritten, rewrite_group
from cachekeeper.snapshot.manifest import FileEntry, Manifest
from cachekeeper.snapshot.scan import open_nofollow

__all__ = ["SAFE_MODE_MASK", "Writer", "is_present", "links_above"]

_BATCH_BYTES = 128 << 20
_BATCH_FILES = 1024
_POOLED_BYTES = 4 << 20  # blobs up to this size are hashed and written by a thread pool
_MAX_IN_FLIGHT = 64
# A restored file keeps the manifest's mode bits less group and other write: a snapshot
# cannot make kernels that another local user may rewrite (and the next job then load).
SAFE_MODE_MASK = 0o755
_STAGING_RE = re.compile(r"^(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")

Progress = Callable[[int], None]


def is_present(
    entry: FileEntry, final: Path, paths: set[str], root: Path, *, exact: bool = False
) -> bool | None:
    """True: same file there; False: a different thing there (conflict); None: absent.

    ``final`` is ``root / entry.path``; what is there is read through descriptors
    (``scan.open_nofollow``): a folder above it or the file itself swapped for a link
    after the ``lstat`` is a conflict, never a read of what the link points at.

    A Triton group file counts as present when a restore into ``root`` rewrote it
    (``looks_rewritten``) — unless ``exact`` (a trusted restore): then only the bytes
    this restore writes count, which are known once its blob is verified, so such a
    file is None here (fetch it) and ``Writer`` compares it at publish time.
    """
    try:
        final.lstat()  # the common case, nothing there, costs one system call
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return False
    try:
        fd = open_nofollow(root, entry.path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return False  # a link, or a file where a folder goes
        raise
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        if st.st_size == entry.size_bytes and hash_file(fd)[0] == entry.digest:
            return True
        if is_group_path(entry.path) and st.st_size < (16 << 20):
            if exact:
                return None
            fh.seek(0)
            return looks_rewritten(fh.read(), paths=paths, root=root)
    return False


def links_above(root: Path, rel_path: str, verdicts: dict[str, bool]) -> bool:
    """True when a folder above ``rel_path`` under ``root`` is a link or not a folder.

    ``verdicts`` caches each folder's answer (one ``lstat`` per folder per restore).
    A missing folder is fine: the writer makes it, without following links.
    """
    prefix = ""
    for part in rel_path.split("/")[:-1]:
        prefix = f"{prefix}/{part}" if prefix else part
        bad = verdicts.get(prefix)
        if bad is None:
            try:
                bad = not stat.S_ISDIR(os.lstat(root / prefix).st_mode)
            except FileNotFoundError:
                return False  # nothing below a missing folder exists yet
            except NotADirectoryError:
                bad = True
            verdicts[prefix] = bad
        if bad:
            return True
    return False


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_DIR_FDS = 64


class _Folders:
    """Folders under the cache dir, opened and made without following any link.

    Each folder is opened relative to its parent's descriptor with ``O_NOFOLLOW``, so a
    link (or a file) at any depth stops the walk (``None``) instead of leading outside.
    At most ``_MAX_DIR_FDS`` descriptors stay open (least recently used are closed).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._refused: set[str] = set()

    def open(self, rel_dir: str) -> int | None:
        """A descriptor of ``root/rel_dir``, made if missing; None past a link or file."""
        if not rel_dir:
            return self.root_fd
        fd = self._fds.get(rel_dir)
        if fd is not None:
            self._fds.move_to_end(rel_dir)
            return fd
        if rel_dir in self._refused:
            return None
        parent, _, name = rel_dir.rpartition("/")
        parent_fd = self.open(parent)
        if parent_fd is None:
            return None
        try:
            fd = self._open_child(parent_fd, name)
        except OSError as exc:  # name the folder: a name relative to a descriptor says nothing
            raise OSError(exc.errno, exc.strerror, str(self.root / rel_dir)) from exc
        if fd is None:
            self._refused.add(rel_dir)
            return None
        self._fds[rel_dir] = fd
        if len(self._fds) > _MAX_DIR_FDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    @staticmethod
    def _open_child(parent_fd: int, name: str) -> int | None:
        for _ in range(2):
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):  # made meanwhile: open decides
                    os.mkdir(name, FOLDER_MODE, dir_fd=parent_fd)  # mkdirat: never follows a link
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    return None  # a link or a file where a folder should be
                raise
        return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        os.close(self.root_fd)


# -- staging and writing -----------------------------------------------------------------


def _sweep_stale_staging(staging_fd: int) -> None:
    """Remove staging folders of dead restores on this host (only names we create, found
    through the staging folder's descriptor; a link there is not a folder of ours)."""
    host = socket.gethostname()
    with os.scandir(staging_fd) as entries:
        for entry in entries:
            found = _STAGING_RE.match(entry.name)
            if not found or found["host"] != host or not entry.is_dir(follow_symlinks=False):
                continue
            if not pid_alive(int(found["pid"])):
                shutil.rmtree(entry.name, dir_fd=staging_fd, ignore_errors=True)


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


def _rename_noreplace(src: Path, dir_fd: int, name: str) -> bool | None:
    """Atomically rename ``src`` to ``name`` in folder ``dir_fd`` unless it exists
    (Linux renameat2).

    True: renamed. False: the name exists (nothing changed). None: not supported here
    (old kernel or libc, or a filesystem without RENAME_NOREPLACE): use link instead.
    """
    libc = _libc()
    fn = getattr(libc, "renameat2", None) if libc is not None else None
    if fn is None:
        return None
    if fn(_AT_FDCWD, os.fsencode(src), dir_fd, os.fsencode(name), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return None
    raise OSError(err, os.strerror(err), name)


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


def _write_all(out: BinaryIO, data: bytes | memoryview) -> None:
    """Write every byte: an unbuffered write may write only part (a filling disk does
    that before it refuses with ENOSPC), and a short file must never pass as verified."""
    view = memoryview(data)
    while view:
        view = view[out.write(view) :]


def _write_settled(path: Path, data: bytes) -> None:
    with open(path, "wb", buffering=0) as out:
        _write_all(out, data)
        _settle(out.fileno())


class Writer:
    """Writes verified blobs into staging, then makes them appear in the cache dir."""

    def __init__(
        self,
        manifest: Manifest,
        cache_dir: Path,
        progress: Progress | None,
        *,
        hold: bool = False,
        exact: bool = False,
    ) -> None:
        """``hold``: publish nothing before the final ``flush`` (all-or-nothing restores).
        ``exact``: a file found in place counts as present only with exactly the bytes
        this restore would write (trusted restores; see ``is_present``)."""
        self.cache_dir = cache_dir
        self.hold = hold
        self.exact = exact
        self.paths = {e.path for e in manifest.files}
        self.progress = progress
        # Staging is reached through descriptors (marker.StateDir): a link planted at
        # .cachekeeper/staging, or swapped in later, never takes a temp file elsewhere.
        self._state = StateDir(cache_dir, create=True)
        try:
            self._staging_root = self._state.folder("staging")
            _sweep_stale_staging(self._staging_root)
            self._staging_name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.mkdir(self._staging_name, 0o700, dir_fd=self._staging_root)
            self._staging_fd = os.open(self._staging_name, _DIR_FLAGS, dir_fd=self._staging_root)
        except BaseException:
            self._state.close()
            raise
        self.staging = self._state.path_of(
            self._staging_fd,
            fallback=cache_dir / STATE_DIR / "staging" / self._staging_name,
        )
        self.pending: list[tuple[Path, FileEntry]] = []
        self.pending_bytes = 0
        self.written = 0
        self.bytes_written = 0
        self.skipped = 0
        self.conflicts: list[str] = []
        self._folders = _Folders(cache_dir)
        self._lock = threading.Lock()
        # Daemon threads (cachekeeper.daemon_pool): a writer stuck on a hung filesystem
        # never keeps the pre-job hook's process alive past its deadline.
        self._pool = DaemonPool(min(8, (os.cpu_count() or 2) * 2), name="ck-restore")
        self._futures: deque[Future[None]] = deque()
        self._noreplace = True  # renameat2(RENAME_NOREPLACE) until it proves unsupported
        # One publisher thread: a batch is flushed to disk and linked into place while the
        # main thread decompresses and writes the next one (at most one batch in flight).
        self._publisher = DaemonPool(1, name="ck-publish")
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
                refuse_oversize(total, size_bytes=declared, digest=digest, path=first.path)
                parts.append(chunk)
            self._futures.append(self._pool.submit(self._store, digest, b"".join(parts), entries))
            if len(self._futures) > _MAX_IN_FLIGHT:
                self._futures.popleft().result()
        else:
            tmp = self._tmp()
            check = BlobCheck(digest=digest, size_bytes=declared, path=first.path)
            with open(tmp, "wb", buffering=0) as out:
                while chunk := stream.read(min(CHUNK_BYTES, declared - check.total_bytes + 1)):
                    check.update(chunk)
                    _write_all(out, chunk)
                _settle(out.fileno())
            check.finish()
            self._queue(tmp, entries)
        if self.hold:
            return
        if self.pending_bytes >= _BATCH_BYTES or len(self.pending) >= _BATCH_FILES:
            error = self._drain()
            if error is not None:
                raise error
            self._flush_async()

    def _store(self, digest: str, data: bytes, entries: list[FileEntry]) -> None:
        """(pool thread) Verify a small blob's bytes, write them to staging, queue them."""
        first = entries[0]
        verify_bytes(data, digest=digest, size_bytes=first.size_bytes, path=first.path)
        tmp = self._tmp()
        _write_settled(tmp, data)
        self._queue(tmp, entries)

    def _queue(self, tmp: Path, entries: list[FileEntry]) -> None:
        """Queue a verified staging file for every entry that uses it."""
        queued: list[tuple[Path, FileEntry]] = []
        tmp_used = False
        for i, entry in enumerate(entries):
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
        try:
            self._publish_one(tmp, entry)
        except OSError as exc:
            if exc.filename is not None and os.path.isabs(os.fsdecode(exc.filename)):
                if not os.fsdecode(exc.filename).startswith(str(self.staging)):
                    raise
            # a name relative to a folder's descriptor, or our staging file: name the path
            raise OSError(exc.errno, exc.strerror, str(self.cache_dir / entry.path)) from exc

    def _publish_one(self, tmp: Path, entry: FileEntry) -> None:
        folder, _, name = entry.path.rpartition("/")
        renamed: bool | None = None
        try:
            os.chmod(tmp, entry.mode & SAFE_MODE_MASK)  # never group- or other-writable
            dir_fd = self._folders.open(folder)
            if dir_fd is None:  # a link or a file above it: never written through
                self.conflicts.append(entry.path)
                return
            renamed = _rename_noreplace(tmp, dir_fd, name) if self._noreplace else None
            if renamed is False:
                self._classify_existing(entry, tmp)
                return
            if renamed is None:
                self._noreplace = False
                self._link_into_place(tmp, dir_fd, name, entry)
                return
            self.written += 1
            self.bytes_written += entry.size_bytes
        finally:
            if not renamed:  # renamed: the staging name is gone already
                tmp.unlink(missing_ok=True)

    def _link_into_place(self, tmp: Path, dir_fd: int, name: str, entry: FileEntry) -> None:
        """The portable path: hard link (fails if ``name`` exists), else check + replace."""
        try:
            os.link(tmp, name, dst_dir_fd=dir_fd)
        except FileExistsError:
            self._classify_existing(entry, tmp)
            return
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            try:  # no hard links here: check, then replace
                os.lstat(name, dir_fd=dir_fd)
            except FileNotFoundError:
                os.replace(tmp, name, dst_dir_fd=dir_fd)
            else:
                self._classify_existing(entry, tmp)
                return
        self.written += 1
        self.bytes_written += entry.size_bytes

    def _classify_existing(self, entry: FileEntry, tmp: Path) -> None:
        """Someone's file is where ``entry`` goes: the same (skipped) or not (conflict)."""
        final = self.cache_dir / entry.path
        if self.exact and is_group_path(entry.path):
            # only what this restore verified counts
            present = _same_bytes(self.cache_dir, entry.path, tmp)
        else:
            present = bool(is_present(entry, final, self.paths, self.cache_dir))
        if present:
            self.skipped += 1
        else:
            self.conflicts.append(entry.path)

    def close(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)
        with contextlib.suppress(Exception):  # an error here was raised by flush already
            self._wait_publishing()
        self._publisher.shutdown(wait=True)
        self._folders.close()
        os.close(self._staging_fd)
        shutil.rmtree(self._staging_name, dir_fd=self._staging_root, ignore_errors=True)
        self._state.close()


def _same_bytes(root: Path, rel: str, tmp: Path) -> bool:
    """True when ``root/rel`` (reached without following a link) is a regular file with
    exactly ``tmp``'s bytes."""
    try:
        fd = open_nofollow(root, rel)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != tmp.stat().st_size:
                return False
            return fh.read() == tmp.read_bytes()
    except OSError:
        return False
