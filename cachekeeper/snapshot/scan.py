"""Which files of a cache dir a snapshot takes (see ``cachekeeper.snapshot.make``'s docstring),
and reading them back exactly as they were scanned.

A cache dir changes under our feet: a job compiles into it while a push reads it, and
another local user who can write there can swap an entry for a link between the scan and
the read (a push then uploads a 0600 file from outside the cache dir). So the scan and
every read after it are **descriptor-relative** (``CacheTree``): the dir is opened once;
each folder is opened from its parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY``, each
file with ``O_NOFOLLOW`` (and ``O_NONBLOCK``, so a FIFO swapped in cannot hang the open);
the opened file's ``fstat`` is compared with the scan's (device, inode, size, modification
time), before and after it is read. A link met anywhere is ``LinkInCacheDir``; any other
change (a file rewritten, replaced or gone since the scan) is ``CacheDirChanged``; both
name the path. What is read is what was scanned, or nothing.

``open_nofollow`` is the same walk for a path named by a manifest rather than a scan (the
restore's check of what is already in place).

Its own module, stdlib only, so that ``cachekeeper postjob`` can list a cache dir without
importing the snapshot stack (archive, signing, zstandard): the hook's start-up budget.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cachekeeper.errors import CacheDirChanged, LinkInCacheDir

__all__ = ["CacheTree", "ScannedFile", "is_excluded", "open_nofollow", "scan_dir", "scan_files"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO (or a device) swapped in for a file never waits for a writer;
# reads of a regular file ignore it.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_MAX_DIR_FDS = 64


def is_excluded(name: str, *, is_dir: bool) -> bool:
    """True for a directory entry name that never enters a snapshot (see module docstring)."""
    if name.startswith("."):
        return True
    if is_dir:
        return name == "locks"
    return name.endswith((".lock", ".tmp", ".partial"))


@dataclass(frozen=True)
class ScannedFile:
    """A regular file of a cache dir as the scan saw it: what a read must find again."""

    rel: str  # relative posix path under the cache dir
    mode: int  # permission bits
    size_bytes: int
    mtime_ns: int
    dev: int
    ino: int


class CacheTree:
    """A cache dir opened once, scanned and read relative to its descriptor (see the module
    docstring). Close it, or use it as a context manager.

    The dir itself must not be a link (``LinkInCacheDir``); one that is missing or not a
    folder is FileNotFoundError naming it.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        try:
            self.fd = os.open(self.root, _DIR_FLAGS)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LinkInCacheDir(f"cache dir {self.root} is itself a symbolic link") from exc
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise FileNotFoundError(
                    errno.ENOENT, "does not exist or is not a directory", str(self.root)
                ) from exc
            raise
        self._folders: OrderedDict[str, int] = OrderedDict()
        self.excluded = 0  # entries the last scan left out (locks, temp files, dot-names)

    # -- the scan ---------------------------------------------------------------------------
    def scan(self) -> list[ScannedFile]:
        """Every file a snapshot takes, sorted by path. Raises LinkInCacheDir for a link."""
        found: list[ScannedFile] = []
        self.excluded = 0
        self._scan_folder(self.fd, "", found)
        found.sort(key=lambda f: f.rel)
        return found

    def _scan_folder(self, fd: int, prefix: str, found: list[ScannedFile]) -> None:
        with os.scandir(fd) as listing:
            entries = list(listing)
        for entry in entries:
            rel = prefix + entry.name
            if entry.is_symlink():
                raise LinkInCacheDir(f"{rel} in {self.root} is a symbolic link; refusing to follow")
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_excluded(entry.name, is_dir=is_dir):
                self.excluded += 1
                continue
            if is_dir:
                child = self._open_folder(fd, entry.name, rel)
                try:
                    self._scan_folder(child, rel + "/", found)
                finally:
                    os.close(child)
            elif entry.is_file(follow_symlinks=False):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since the listing (a cache cleaning its temp files)
                if not stat.S_ISREG(st.st_mode):
                    raise self._changed(rel, "is no longer a regular file")
                found.append(
                    ScannedFile(
                        rel=rel,
                        mode=st.st_mode & 0o777,
                        size_bytes=st.st_size,
                        mtime_ns=st.st_mtime_ns,
                        dev=st.st_dev,
                        ino=st.st_ino,
                    )
                )

    def _open_folder(self, parent_fd: int, name: str, rel: str) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise LinkInCacheDir(
                    f"{rel} in {self.root} was replaced by a symbolic link or a file while it"
                    " was read; refusing to follow it"
                ) from exc
            if exc.errno == errno.ENOENT:
                raise self._changed(rel, "is gone") from exc
            raise OSError(exc.errno, exc.strerror, str(self.root / rel)) from exc

    def _folder(self, rel_dir: str) -> int:
        """A descriptor of the folder ``rel_dir``, each level opened without following a
        link (at most ``_MAX_DIR_FDS`` kept open, least recently used closed first)."""
        if not rel_dir:
            return self.fd
        fd = self._folders.get(rel_dir)
        if fd is not None:
            self._folders.move_to_end(rel_dir)
            return fd
        parent, _, name = rel_dir.rpartition("/")
        fd = self._open_folder(self._folder(parent), name, rel_dir)
        self._folders[rel_dir] = fd
        if len(self._folders) > _MAX_DIR_FDS:
            os.close(self._folders.popitem(last=False)[1])
        return fd

    # -- reading what was scanned -----------------------------------------------------------
    def open_scanned(self, scanned: ScannedFile) -> BinaryIO:
        """The file the scan saw, open for reading; LinkInCacheDir when a link took its
        place, CacheDirChanged when it is another file, or the same one changed, or gone."""
        folder, _, name = scanned.rel.rpartition("/")
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self._folder(folder))
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LinkInCacheDir(
                    f"{scanned.rel} in {self.root} was replaced by a symbolic link after the"
                    " scan; refusing to follow it"
                ) from exc
            if exc.errno == errno.ENOENT:
                raise self._changed(scanned.rel, "is gone") from exc
            raise OSError(exc.errno, exc.strerror, str(self.root / scanned.rel)) from exc
        try:
            self._check(os.fstat(fd), scanned, when="since the scan")
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    @contextlib.contextmanager
    def reading(self, scanned: ScannedFile) -> Iterator[BinaryIO]:
        """``open_scanned``, checked again once the ``with`` block has read it: a file
        written to while it was read is CacheDirChanged, never half old and half new."""
        with self.open_scanned(scanned) as fh:
            yield fh
            self._check(os.fstat(fh.fileno()), scanned, when="while it was read")

    def _check(self, st: os.stat_result, scanned: ScannedFile, *, when: str) -> None:
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (scanned.dev, scanned.ino):
            raise self._changed(scanned.rel, f"was replaced by another file {when}")
        if st.st_size != scanned.size_bytes or st.st_mtime_ns != scanned.mtime_ns:
            raise self._changed(scanned.rel, f"was written to {when}")

    def _changed(self, rel: str, what: str) -> CacheDirChanged:
        return CacheDirChanged(
            f"{rel} in {self.root} {what}: a process is changing the cache dir; run again"
            " once it is done",
            extra={"path": rel},
        )

    def close(self) -> None:
        for fd in self._folders.values():
            os.close(fd)
        self._folders.clear()
        os.close(self.fd)

    def __enter__(self) -> CacheTree:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def scan_files(root: Path) -> list[ScannedFile]:
    """Every file of ``root`` a snapshot takes (``CacheTree.scan``), sorted by path."""
    with CacheTree(root) as tree:
        return tree.scan()


def scan_dir(root: Path) -> list[tuple[str, Path, int]]:
    """``(relative posix path, absolute path, mode)`` of every file a snapshot takes: a
    listing. To read the files, use ``CacheTree`` (a path may lead elsewhere by then).

    Raises LinkInCacheDir for a symbolic link, naming it.
    """
    root = Path(root)
    return [(f.rel, root / f.rel, f.mode) for f in scan_files(root)]


def open_nofollow(root: Path, rel: str) -> int:
    """A read-only descriptor of ``root/rel``, every folder below ``root`` and the file
    itself opened without following a link (``root`` is the caller's: it may be one).

    Raises OSError: ENOENT when something is missing, ELOOP or ENOTDIR when a link (or a
    file where a folder goes) is in the way. The caller ``fstat``-s what it got.
    """
    parts = rel.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        return os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)
