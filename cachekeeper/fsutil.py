"""Atomic file writes, with one durability rule for every file cachekeeper writes whole.

The rule: write a unique temp file in the destination's own folder (same filesystem, so
the rename is atomic), fsync it, ``os.replace`` it onto the destination, then fsync the
folder so the rename itself survives a crash. Readers see the old file or the new one,
never a part. On any error the temp file is removed and the destination is untouched.
Temp names are ``.<name>.<random>.tmp``: snapshots never include ``*.tmp`` files.

Writers that stream and verify as they go (the blob store, the restore writer) apply the
same rule with their own temp folders; this module is for files written in one piece.

**Secrets** (an env file holding a node's token, a key): ``atomic_write_secret`` creates
the temp file ``0600`` in the ``open`` itself (``O_CREAT | O_EXCL | O_NOFOLLOW``), never
readable by others for an instant: a ``chmod`` after the open would leave a window in
which another local user opens the file and keeps reading it. The rename then replaces
whatever was at the destination (a ``0644`` file, a link) rather than writing through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "atomic_writer",
    "atomic_write_bytes",
    "atomic_write_secret",
    "atomic_write_text",
    "fsync_dir",
    "unwritable_dir",
]


def unwritable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be used as a folder to write in (made when missing), or None.

    It is proved by writing: an unnamed ``O_TMPFILE`` there (nothing to clean up, nothing
    visible), else a named temp file removed at once. Permission bits alone would say yes
    to root on a read-only mount. Costs a few system calls (the pre-job hook runs it).
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "it is not a folder"
    except NotADirectoryError:
        return "a part of its path is a file"
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_TMPFILE", 0) | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.EISDIR):
            return "it is not a folder" if exc.errno == errno.ENOTDIR else exc.strerror
        probe = path / f".cachekeeper-probe.{uuid.uuid4().hex}.tmp"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as named:
            return named.strerror or str(named)
        os.unlink(probe)
    os.close(fd)
    return None


def fsync_dir(path: Path) -> None:
    """fsync a folder, so renames into it are durable (a no-op where folders cannot be)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder; the rename is still atomic
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path, *, mode: int | None = None) -> Iterator[BinaryIO]:
    """A binary file that appears at ``path`` only when the ``with`` block succeeds.

    ``mode`` sets the permission bits (default: what ``open`` gives, i.e. 0o666 & ~umask).
    The temp file is created with them (the umask can only take bits away), so a narrow
    mode is never wider for an instant; bits the umask took are given back before a byte
    is written.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as out:
            if mode is not None and os.fstat(fd).st_mode & 0o7777 != mode:
                os.fchmod(fd, mode)  # only ever adds bits the umask took: never a secret's
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically and durably (see the module docstring)."""
    with atomic_writer(path, mode=mode) as out:
        out.write(data)


def atomic_write_secret(path: Path, text: str, *, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically, readable by its owner only (``0600`` from the
    moment the temp file exists: see the module docstring)."""
    atomic_write_bytes(path, text.encode(encoding), mode=0o600)


def atomic_write_text(path: Path, text: str, *, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically and durably (see the module docstring)."""
    atomic_write_bytes(path, text.encode(encoding))
