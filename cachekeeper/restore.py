"""Restore a snapshot into a cache dir, safely (DESIGN section 5).

The rules, and how this module keeps them:

- **Nothing in the target is deleted or truncated.** A file already present with the
  snapshot's digest is skipped; a different file (or a link, folder, ...) at a snapshot
  path is kept as it was and reported in ``RestoreReport.conflicts``. Conflicts are a
  report, not an error: the CLI prints one warning line per conflict and exits 0, because
  a cache dir that already holds some other version of an entry is still a usable cache.
- **Every byte is verified before it becomes visible.** Each blob streams into a temp
  file in this process's staging folder, hashed while written; more bytes than declared
  stop it at once (a decompression bomb is cut off at the declared size). Each verified
  file's data is written to the device (``sync_file_range``, else ``fdatasync``; never a
  whole-filesystem flush), chmod-ed to the manifest mode, then appears with
  ``renameat2(RENAME_NOREPLACE)`` (else ``os.link(tmp, final)``), which fails rather than
  overwrite when someone created the file meanwhile (that file is then classified as
  skipped or conflict). Where neither is supported, an existence check and ``os.replace``
  are the fall-back.
- **Manifest-level problems are refused before anything is written**: bad paths, links
  and duplicates are refused by ``Manifest`` itself; here also paths inside our own
  ``.cachekeeper/`` folder and one digest declared with two sizes. Blob-level problems
  (missing, corrupt, too large, an archive member that is not a regular ``blobs/<sha256>``
  of the manifest) raise a one-line error naming the entry; the files verified before it
  stay, nothing partial is visible, and a rerun completes the restore.
- **Concurrent restores** into one dir serialize on ``target_lock`` (flock on
  ``.cachekeeper/lock``); the later ones find the work done and skip it. The lock only
  avoids duplicate work: flock is a no-op on some NFS/Lustre mounts, and correctness
  never depends on it (link-without-clobber does).
- **Signed snapshots** (``trusted_keys``, see ``cachekeeper.signing``): with a trust list,
  the manifest's signature is checked before the target is touched at all (an unsigned,
  untrusted or tampered manifest raises ``SignatureInvalid``), and the restore becomes
  all-or-nothing: every blob is verified in staging first, and files appear only once
  all of them verified, so one changed byte in any blob leaves the target as it was.
  The marker then records the key that signed the snapshot, so ``is_restored`` with
  ``trusted_key_ids`` accepts only a dir a trusted restore completed.
- **Triton group files** (``__grp__*.json``) are verified against their digest, then
  their absolute child paths are rewritten to the new root (see ``triton_groups``).

Layout of what this module writes into a cache dir (snapshots exclude dot-names)::

    cache_dir/.cachekeeper/
      lock                       # flock target; empty
      staging/<host>-<pid>-<rand>/  # this restore's temp files; removed when it ends, and
                                 # by the next restore when that process is dead
      restored/<snapshot id>     # marker written after a complete, conflict-free restore

**Fast no-op check (``is_restored``)**: the pre-job hook calls it before anything else.
It reads the marker (JSON listing each path and size) and ``stat``-s every path,
checking existence and size (existence only for rewritten group files); no hashing. It
takes a few milliseconds for thousands of files. A file changed in place with the same
size is not detected by it; a full ``restore`` hashes and reports it as a conflict.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import zstandard

from cachekeeper.archive import (
    MANIFEST_MEMBER,
    TarFormatError,
    TarMember,
    blob_digest,
    iter_tar,
    open_archive_stream,
)
from cachekeeper.errors import (
    BlobMissing,
    BlobTooLarge,
    DigestMismatch,
    InvalidManifest,
    UnsafePath,
)
from cachekeeper.manifest import FileEntry, Manifest, is_digest
from cachekeeper.restore_writer import STATE_DIR, Progress, Writer, is_present
from cachekeeper.signing import TrustedKey, verify_manifest
from cachekeeper.snapshot import hash_file, read_archive_manifest, scan_dir
from cachekeeper.triton_groups import is_group_path

__all__ = [
    "BlobSource",
    "RestoreReport",
    "restore",
    "restore_from_tar",
    "restore_archive",
    "merge_tree",
    "needed_digests",
    "is_restored",
    "target_lock",
    "STATE_DIR",
]


class BlobSource(Protocol):
    """Where restore reads blobs: ``open(digest)`` returns the uncompressed bytes."""

    def open(self, digest: str) -> BinaryIO: ...


@dataclass(frozen=True)
class RestoreReport:
    """What a restore did (or, with ``dry_run``, would do)."""

    snapshot_id: str
    written: int
    skipped: int
    conflicts: list[str]
    bytes_written: int
    dry_run: bool
    planned: list[str] = field(default_factory=list)  # paths to write (dry runs only)

    def to_dict(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "written": self.written,
            "skipped": self.skipped,
            "conflicts": list(self.conflicts),
            "bytes_written": self.bytes_written,
            "dry_run": self.dry_run,
            "planned": list(self.planned),
        }


# -- the lock ----------------------------------------------------------------------------
_held: dict[str, int] = {}
_held_guard = threading.Lock()


@contextlib.contextmanager
def target_lock(cache_dir: Path) -> Iterator[None]:
    """Exclusive flock on ``cache_dir/.cachekeeper/lock`` (re-entrant within a process).

    It only avoids duplicate work; where flock is unsupported it silently does nothing.
    """
    state = Path(cache_dir) / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(state)
    with _held_guard:
        if _held.get(key):
            _held[key] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _held_guard:
                _held[key] -= 1
        return
    fd = os.open(state / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        with _held_guard:
            _held[key] = 1
        try:
            yield
        finally:
            with _held_guard:
                _held.pop(key, None)
    finally:
        os.close(fd)  # closing releases the flock


# -- checks and planning -----------------------------------------------------------------
def _check_manifest(manifest: Manifest) -> dict[str, list[FileEntry]]:
    """Refuse what Manifest does not; group entries by digest."""
    by_digest: dict[str, list[FileEntry]] = {}
    for entry in manifest.files:
        if entry.path.split("/", 1)[0] == STATE_DIR:
            raise UnsafePath(f"manifest path {entry.path!r} is inside cachekeeper's own folder")
        group = by_digest.setdefault(entry.digest, [])
        if group and group[0].size_bytes != entry.size_bytes:
            raise InvalidManifest(
                f"manifest declares blob {entry.digest} as {group[0].size_bytes} bytes "
                f"({group[0].path}) and as {entry.size_bytes} bytes ({entry.path})"
            )
        group.append(entry)
    return by_digest


@dataclass
class _Plan:
    todo: dict[str, list[FileEntry]]
    skipped: int = 0
    conflicts: list[str] = field(default_factory=list)


def _plan(manifest: Manifest, cache_dir: Path) -> _Plan:
    by_digest = _check_manifest(manifest)
    paths = {e.path for e in manifest.files}
    plan = _Plan(todo={})
    for digest, entries in by_digest.items():
        for entry in entries:
            present = is_present(entry, cache_dir / entry.path, paths, cache_dir)
            if present is None:
                plan.todo.setdefault(digest, []).append(entry)
            elif present:
                plan.skipped += 1
            else:
                plan.conflicts.append(entry.path)
    return plan


def needed_digests(manifest: Manifest, cache_dir: Path) -> set[str]:
    """Digests of the manifest's files that ``cache_dir`` lacks (a stat per file)."""
    _check_manifest(manifest)
    root = Path(cache_dir)
    return {e.digest for e in manifest.files if not os.path.lexists(root / e.path)}


def _write_marker(manifest: Manifest, cache_dir: Path, *, key_id: str | None) -> None:
    folder = cache_dir / STATE_DIR / "restored"
    folder.mkdir(parents=True, exist_ok=True)
    files = [[e.path, -1 if is_group_path(e.path) else e.size_bytes] for e in manifest.files]
    tmp = folder / f".{uuid.uuid4().hex}.tmp"
    body = {"id": manifest.id, "files": files, "key_id": key_id}
    tmp.write_text(json.dumps(body), encoding="utf-8")
    os.replace(tmp, folder / manifest.id)


def is_restored(
    manifest_id: str, cache_dir: Path, *, trusted_key_ids: Collection[str] | None = None
) -> bool:
    """The pre-job hook's fast check: marker present and every file there with its size.

    With ``trusted_key_ids`` (non-empty), the marker must also say that a restore which
    verified the signature of one of those keys wrote it.
    """
    if not is_digest(manifest_id):
        return False
    root = os.fspath(cache_dir)
    try:
        with open(os.path.join(root, STATE_DIR, "restored", manifest_id), "rb") as fh:
            marker = json.loads(fh.read())
        if trusted_key_ids and marker.get("key_id") not in trusted_key_ids:
            return False
        files = marker["files"]
        stat = os.stat
        for path, size in files:
            st = stat(f"{root}/{path}")
            if size >= 0 and st.st_size != size:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


# -- the restore paths -------------------------------------------------------------------
def _report(
    manifest: Manifest, plan: _Plan, writer: Writer | None, *, dry_run: bool
) -> RestoreReport:
    if writer is None:
        planned = sorted(e.path for entries in plan.todo.values() for e in entries)
        return RestoreReport(
            snapshot_id=manifest.id,
            written=0,
            skipped=plan.skipped,
            conflicts=sorted(plan.conflicts),
            bytes_written=0,
            dry_run=dry_run,
            planned=planned if dry_run else [],
        )
    return RestoreReport(
        snapshot_id=manifest.id,
        written=writer.written,
        skipped=plan.skipped + writer.skipped,
        conflicts=sorted(plan.conflicts + writer.conflicts),
        bytes_written=writer.bytes_written,
        dry_run=False,
    )


def _run(
    manifest: Manifest,
    cache_dir: Path,
    feed: Callable[[_Plan, Writer], None],
    *,
    dry_run: bool,
    progress: Progress | None,
    trusted_keys: Sequence[TrustedKey] | None,
) -> RestoreReport:
    cache_dir = Path(cache_dir)
    # Both refused before the target is touched at all.
    key_id = verify_manifest(manifest, trusted_keys) if trusted_keys else None
    _check_manifest(manifest)
    if dry_run:
        plan = _plan(manifest, cache_dir) if cache_dir.is_dir() else _empty_plan(manifest)
        return _report(manifest, plan, None, dry_run=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with target_lock(cache_dir):
        plan = _plan(manifest, cache_dir)
        if not plan.todo:
            if not plan.conflicts:
                _write_marker(manifest, cache_dir, key_id=key_id)
            return _report(manifest, plan, None, dry_run=False)
        # Signed: all-or-nothing (nothing appears until every blob verified).
        writer = Writer(manifest, cache_dir, progress, hold=key_id is not None)
        try:
            try:
                feed(plan, writer)
            except BaseException:
                if key_id is None:
                    with contextlib.suppress(Exception):
                        writer.flush()  # what is verified may stay; a rerun does the rest
                raise
            writer.flush()
        finally:
            writer.close()
        report = _report(manifest, plan, writer, dry_run=False)
        if not report.conflicts:
            _write_marker(manifest, cache_dir, key_id=key_id)
        return report


def _empty_plan(manifest: Manifest) -> _Plan:
    plan = _Plan(todo={})
    for entry in manifest.files:
        plan.todo.setdefault(entry.digest, []).append(entry)
    return plan


def restore(
    manifest: Manifest,
    source: BlobSource,
    cache_dir: Path,
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
    trusted_keys: Sequence[TrustedKey] | None = None,
) -> RestoreReport:
    """Restore ``manifest`` into ``cache_dir``, reading blobs from ``source``.

    With ``trusted_keys`` (non-empty), only a manifest signed by one of them is restored.
    """

    def feed(plan: _Plan, writer: Writer) -> None:
        for digest, entries in list(plan.todo.items()):
            try:
                stream = source.open(digest)
            except BlobMissing as exc:
                raise BlobMissing(
                    f"blob {digest} for {entries[0].path} is missing from the source",
                    extra={"missing": [digest], "path": entries[0].path},
                ) from exc
            try:
                with stream:
                    writer.write_blob(digest, stream, entries)
            except zstandard.ZstdError as exc:
                raise DigestMismatch(
                    f"blob {digest} for {entries[0].path} is corrupt: {exc}"
                ) from exc
            del plan.todo[digest]

    return _run(
        manifest, cache_dir, feed, dry_run=dry_run, progress=progress, trusted_keys=trusted_keys
    )


def restore_from_tar(
    manifest: Manifest,
    tar_stream: BinaryIO,
    cache_dir: Path,
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
    trusted_keys: Sequence[TrustedKey] | None = None,
) -> RestoreReport:
    """Restore from an uncompressed tar stream of ``blobs/<sha256>`` members (may be
    non-seekable, e.g. an HTTP response); a ``manifest.json`` member is skipped."""
    declared = {e.digest: e for e in manifest.files}

    def feed(plan: _Plan, writer: Writer) -> None:
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
            if member.size > entry.size_bytes:
                raise BlobTooLarge(
                    f"blob {digest} for {entry.path} is {member.size} bytes in the "
                    f"archive, larger than its declared {entry.size_bytes}"
                )
            entries = plan.todo.pop(digest, None)
            if entries is None:
                continue  # already present in the target
            writer.write_blob(digest, member.stream, entries)  # type: ignore[arg-type]
        if plan.todo:
            missing = sorted(e.path for entries in plan.todo.values() for e in entries)
            raise BlobMissing(
                f"blob for {missing[0]} is missing from the snapshot stream "
                f"({len(missing)} files lack their blob)",
                extra={"missing": sorted(plan.todo)},
            )

    return _run(
        manifest, cache_dir, feed, dry_run=dry_run, progress=progress, trusted_keys=trusted_keys
    )


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


def restore_archive(
    path: Path,
    cache_dir: Path,
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
    trusted_keys: Sequence[TrustedKey] | None = None,
) -> RestoreReport:
    """Restore a one-file archive (``snapshot.write_archive``) into ``cache_dir``."""
    manifest = read_archive_manifest(path)
    with open(path, "rb") as fh:
        stream = open_archive_stream(fh)
        try:
            return restore_from_tar(
                manifest,
                stream,
                cache_dir,
                dry_run=dry_run,
                progress=progress,
                trusted_keys=trusted_keys,
            )
        except zstandard.ZstdError as exc:
            raise DigestMismatch(f"{path} is corrupt: {exc}") from exc


class _DirSource:
    def __init__(self, by_digest: dict[str, Path]) -> None:
        self.by_digest = by_digest

    def open(self, digest: str) -> BinaryIO:
        try:
            return open(self.by_digest[digest], "rb")
        except (KeyError, FileNotFoundError) as exc:
            raise BlobMissing(f"blob {digest} is gone from the source dir") from exc


def merge_tree(src_dir: Path, dst_dir: Path) -> RestoreReport:
    """Merge ``src_dir`` into ``dst_dir`` under exactly the restore rules."""
    by_digest: dict[str, Path] = {}
    entries = []
    for rel, path, mode in scan_dir(Path(src_dir)):
        digest, size = hash_file(path)
        by_digest.setdefault(digest, path)
        entries.append(FileEntry(path=rel, digest=digest, size_bytes=size, mode=mode))
    manifest = Manifest(files=tuple(entries), fingerprint={})
    return restore(manifest, _DirSource(by_digest), dst_dir)
