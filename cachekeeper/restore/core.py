"""Restore a snapshot into a cache dir, safely (docs/snapshots.md, "Restore rules").

The rules, and how this module keeps them:

- **Nothing in the target is deleted or truncated.** A file already present with the
  snapshot's digest is skipped; a different file (or a link, folder, ...) at a snapshot
  path is kept as it was and reported in ``RestoreReport.conflicts``. Conflicts are a
  report, not an error: the CLI prints one warning line per conflict and exits 0, because
  a cache dir that already holds some other version of an entry is still a usable cache.
  A different file that a restore of another snapshot wrote there, unchanged since
  (``marker.held_by_restores``: two workloads restored into one per-environment dir both
  hold a C++ kernel's ``.so``, compiled twice into other bytes), is no conflict: it is the
  same cache entry, kept and reported in ``RestoreReport.shared``, and the marker is
  written. A warning is left for what no restore explains.
- **Nothing is written through a link the restore did not create**, at any depth: a
  link (or a file) where a folder above a snapshot path should be makes every file
  below it a conflict. Folders are opened and made relative to the cache dir's
  descriptor without following links (``restore/writer.py`` ``_Folders``), so a link planted
  mid-restore is not followed either. The cache dir itself may be a link.
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
  duplicates and paths inside our own ``.cachekeeper/`` folder are refused by ``Manifest``
  itself (so the server refuses them at publish too); here also one digest declared with
  two sizes. Blob-level problems
  (missing, corrupt, too large, an archive member that is not a regular ``blobs/<sha256>``
  of the manifest) raise a one-line error naming the entry; the files verified before it
  stay, nothing partial is visible, and a rerun completes the restore. The target
  refusing a write (disk full or read-only, a name too long for its filesystem, the dir
  or ``.cachekeeper`` a file, ``.cachekeeper`` a link) is one ``CacheDirUnusable`` line.
- **One owner of the sequence**: ``restore_snapshot`` alone takes the lock, checks
  whether the dir already holds the snapshot, verifies the signature, writes, and
  records the marker. Where the bytes come from is a ``SnapshotSource`` (get the
  manifest; open a stream of the blobs still needed): a local archive file
  (``restore_archive``), a local blob store (``restore``), an uncompressed tar stream
  (``restore_from_tar``), or the server (``cachekeeper.client.pull``, which adds
  resolve and retries under a deadline); see ``restore/sources.py``.
- **Concurrent restores** into one dir serialize on ``target_lock`` (flock on
  ``.cachekeeper/lock``, taken once per restore); the later ones find the work done and
  skip it. The lock only avoids duplicate work: flock is a no-op on some NFS/Lustre
  mounts, and correctness never depends on it (link-without-clobber does).
- **Signed snapshots** (``trusted_keys``, see ``cachekeeper.snapshot.signing``): with a trust list,
  the manifest's signature is checked before the target is touched at all (an unsigned,
  untrusted or tampered manifest raises ``SignatureInvalid``), and the restore becomes
  all-or-nothing: every blob is verified in staging first, and files appear only once
  all of them verified, so one changed byte in any blob leaves the target as it was.
  The marker then records the key that signed the snapshot, so ``is_restored`` with
  ``trusted_key_ids`` accepts only a dir a trusted restore completed. A file already
  there counts as present only with exactly the verified bytes (a Triton group file:
  the verified bytes rewritten to this root); anything else is a conflict, and then no
  marker is written.
- **Triton group files** (``__grp__*.json``) are verified against their digest, then
  their absolute child paths are rewritten to the new root (see ``restore/triton_groups.py``).

Layout of what this module writes into a cache dir (snapshots exclude dot-names)::

    cache_dir/.cachekeeper/
      lock                       # flock target; empty
      staging/<host>-<pid>-<rand>/  # this restore's temp files; removed when it ends, and
                                 # by the next restore when that process is dead
      restored/<snapshot id>     # marker written after a complete, conflict-free restore
      conflicts/<snapshot id>    # the paths it kept because they differ (restore/marker.py)

**Fast no-op check (``is_restored``, in ``cachekeeper.restore.marker`` with the marker itself)**:
``restore_snapshot(..., reuse_marker=True)`` (pull, and through it the pre-job hook, which
also calls it right after its one resolve) stops here when the dir already holds the
snapshot.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from cachekeeper.errors import (
    BlobMissing,
    CacheDirUnusable,
    DigestMismatch,
    InvalidManifest,
)
from cachekeeper.integrity import hash_file
from cachekeeper.restore.marker import (
    held_by_restores,
    is_restored,
    record_conflicts,
    state_dir,
    write_marker,
)
from cachekeeper.restore.sources import (
    ArchiveFileSource,
    BlobSource,
    DirSource,
    SnapshotSource,
    StoreSource,
    TarSource,
)
from cachekeeper.restore.writer import Progress, Writer, is_present, links_above
from cachekeeper.snapshot.archive import TarFormatError
from cachekeeper.snapshot.manifest import FileEntry, Manifest
from cachekeeper.snapshot.scan import CacheTree, ScannedFile
from cachekeeper.snapshot.signing import TrustedKey, verify_manifest

# The package (cachekeeper.restore) is the public import path: it adds is_restored,
# STATE_DIR (restore/marker.py) and the source protocols (restore/sources.py).
__all__ = [
    "RestoreReport",
    "restore_snapshot",
    "restore",
    "restore_from_tar",
    "restore_archive",
    "merge_tree",
    "needed_digests",
    "target_lock",
]


@dataclass(frozen=True)
class RestoreReport:
    """What a restore did (or, with ``dry_run``, would do).

    ``already_restored``: the dir's marker said it holds the snapshot, so nothing was
    looked at (only with ``reuse_marker``; not part of the JSON report).
    """

    snapshot_id: str
    written: int
    skipped: int
    conflicts: list[str]
    bytes_written: int
    dry_run: bool
    planned: list[str] = field(default_factory=list)  # paths to write (dry runs only)
    already_restored: bool = False
    # path -> the snapshot whose restore wrote it with other bytes: the same entry, kept
    shared: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "written": self.written,
            "skipped": self.skipped,
            "conflicts": list(self.conflicts),
            "shared": dict(self.shared),
            "bytes_written": self.bytes_written,
            "dry_run": self.dry_run,
            "planned": list(self.planned),
        }


# -- the lock ----------------------------------------------------------------------------
@contextlib.contextmanager
def target_lock(cache_dir: Path) -> Iterator[None]:
    """Exclusive flock on ``cache_dir/.cachekeeper/lock``; ``restore_snapshot`` takes it once.

    It only avoids duplicate work; where flock is unsupported it silently does nothing.
    Not re-entrant: a second hold from the same process waits for the first. The folder
    and the lock file are opened without following a link (``marker.StateDir``): a link
    planted at either is ``CacheDirUnusable``, never a file made elsewhere.
    """
    with state_dir(cache_dir, create=True) as state:
        fd = state.open_file("lock", os.O_RDWR | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


# -- checks and planning -----------------------------------------------------------------
def _check_manifest(manifest: Manifest) -> dict[str, list[FileEntry]]:
    """Refuse what Manifest does not; group entries by digest."""
    by_digest: dict[str, list[FileEntry]] = {}
    for entry in manifest.files:  # (paths in .cachekeeper/: Manifest refuses them itself)
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
    shared: dict[str, str] = field(default_factory=dict)  # see RestoreReport.shared


def _plan(
    manifest: Manifest, cache_dir: Path, *, exact: bool, trusted_key_ids: set[str] | None = None
) -> _Plan:
    """What to write, skip, and keep (a conflict: something else there, or a link or a
    file where a folder above it should be, which a restore never writes through; a file
    another restore wrote is ``shared``, not a conflict)."""
    by_digest = _check_manifest(manifest)
    paths = {e.path for e in manifest.files}
    plan = _Plan(todo={})
    verdicts: dict[str, bool] = {}
    for digest, entries in by_digest.items():
        for entry in entries:
            if links_above(cache_dir, entry.path, verdicts):
                plan.conflicts.append(entry.path)
                continue
            present = is_present(entry, cache_dir / entry.path, paths, cache_dir, exact=exact)
            if present is None:
                plan.todo.setdefault(digest, []).append(entry)
            elif present:
                plan.skipped += 1
            else:
                plan.conflicts.append(entry.path)
    plan.shared = held_by_restores(
        cache_dir, plan.conflicts, other_than=manifest.id, trusted_key_ids=trusted_key_ids
    )
    plan.conflicts = [p for p in plan.conflicts if p not in plan.shared]
    return plan


def _empty_plan(manifest: Manifest) -> _Plan:
    plan = _Plan(todo={})
    for entry in manifest.files:
        plan.todo.setdefault(entry.digest, []).append(entry)
    return plan


def needed_digests(manifest: Manifest, cache_dir: Path) -> set[str]:
    """Digests of the manifest's files that ``cache_dir`` lacks (a stat per file)."""
    _check_manifest(manifest)
    root = Path(cache_dir)
    return {e.digest for e in manifest.files if not os.path.lexists(root / e.path)}


# -- the one restore ---------------------------------------------------------------------
def _accept(
    source: SnapshotSource, trusted_keys: Sequence[TrustedKey] | None
) -> tuple[Manifest, str | None]:
    """The source's manifest, signature-checked (with a trust list) and rule-checked."""
    manifest = source.manifest()
    key_id = verify_manifest(manifest, trusted_keys) if trusted_keys else None
    _check_manifest(manifest)
    return manifest, key_id


def restore_snapshot(
    source: SnapshotSource,
    cache_dir: Path,
    *,
    trusted_keys: Sequence[TrustedKey] | None = None,
    reuse_marker: bool = False,
    dry_run: bool = False,
    progress: Progress | None = None,
    merged: bool = False,
) -> RestoreReport:
    """Make ``cache_dir`` hold the snapshot ``source`` supplies: lock -> already restored?
    -> verify -> write -> marker, the only place this sequence lives.

    ``merged``: ``merge_tree``'s own use (a local dir of this machine's compile, not a
    snapshot), recorded in the marker so that signing can tell the two apart.

    With ``trusted_keys`` (non-empty), the manifest's signature is checked before the
    target is touched at all, and the restore is all-or-nothing. With ``reuse_marker``,
    a dir whose marker says it holds the snapshot (``is_restored``) is left as it is
    (``already_restored``; the hook's path); without it, every present file is hashed.
    """
    cache_dir = Path(cache_dir)
    key_ids = {k.key_id for k in trusted_keys or ()}
    manifest: Manifest | None = None
    key_id: str | None = None
    if key_ids or dry_run or not reuse_marker or source.snapshot_id is None:
        manifest, key_id = _accept(source, trusted_keys)  # refused before anything is touched
    snapshot_id = source.snapshot_id or (manifest.id if manifest is not None else "")
    if dry_run and manifest is not None:
        plan = (
            _plan(manifest, cache_dir, exact=key_id is not None, trusted_key_ids=key_ids)
            if cache_dir.is_dir()
            else _empty_plan(manifest)
        )
        return _report(manifest, plan, None, dry_run=True)
    if reuse_marker and is_restored(snapshot_id, cache_dir, trusted_key_ids=key_ids):
        return _already(snapshot_id)
    with _hold(cache_dir):
        # another process may have done it while we waited
        if reuse_marker and is_restored(snapshot_id, cache_dir, trusted_key_ids=key_ids):
            return _already(snapshot_id)
        if manifest is None:
            manifest, key_id = _accept(source, trusted_keys)
        plan = _plan(manifest, cache_dir, exact=key_id is not None, trusted_key_ids=key_ids)
        if not plan.todo:
            record_conflicts(manifest, cache_dir, plan.conflicts)  # what verify names
            if not plan.conflicts:
                write_marker(manifest, cache_dir, key_id=key_id, held=plan.shared, merged=merged)
            return _report(manifest, plan, None, dry_run=False)
        # Signed: all-or-nothing (nothing appears until every blob verified), and only the
        # bytes this restore verified count as present.
        trusted = key_id is not None
        writer = Writer(manifest, cache_dir, progress, hold=trusted, exact=trusted)
        try:
            try:
                _feed(source, plan, writer)
            except BaseException:
                if key_id is None:
                    with contextlib.suppress(Exception):
                        writer.flush()  # what is verified may stay; a rerun does the rest
                raise
            writer.flush()
        finally:
            writer.close()
        report = _report(manifest, plan, writer, dry_run=False)
        record_conflicts(manifest, cache_dir, report.conflicts)  # what verify names
        if not report.conflicts:
            write_marker(manifest, cache_dir, key_id=key_id, held=plan.shared, merged=merged)
        return report


@contextlib.contextmanager
def _hold(cache_dir: Path) -> Iterator[None]:
    """The target made, checked and locked; its filesystem refusing a write (full,
    read-only, a name too long) is a one-line ``CacheDirUnusable``, not a traceback."""
    try:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:  # a file where a folder goes
            raise CacheDirUnusable(f"cannot restore into {cache_dir}: {exc.strerror}") from exc
        with target_lock(cache_dir):  # refuses a .cachekeeper that is a file or a link
            yield
    except OSError as exc:
        reason = _REFUSALS.get(exc.errno or 0)
        if reason is None:
            raise
        name = exc.filename2 or exc.filename
        where = f" ({os.fsdecode(name)})" if name else ""
        raise CacheDirUnusable(f"cannot restore into {cache_dir}: {reason}{where}") from exc


_REFUSALS = {
    errno.ENOSPC: "no space left on its filesystem",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "its filesystem is read-only",
    errno.ENAMETOOLONG: "a file name is longer than its filesystem allows",
}


def _feed(source: SnapshotSource, plan: _Plan, writer: Writer) -> None:
    """Write every blob of ``plan.todo`` from the source's stream; name what is missing."""
    with source.open_blobs(dict(plan.todo)) as blobs:
        for digest, stream in blobs:
            entries = plan.todo.pop(digest, None)
            if entries is None:
                continue  # already present in the target
            try:
                writer.write_blob(digest, stream, entries)
            except (zstandard.ZstdError, TarFormatError) as exc:  # corrupt or cut off
                raise DigestMismatch(
                    f"blob {digest} for {entries[0].path} is corrupt: {exc}"
                ) from exc
    if plan.todo:
        missing = sorted(e.path for entries in plan.todo.values() for e in entries)
        raise BlobMissing(
            f"blob for {missing[0]} is missing from the snapshot stream "
            f"({len(missing)} files lack their blob)",
            extra={"missing": sorted(plan.todo)},
        )


def _already(snapshot_id: str) -> RestoreReport:
    return RestoreReport(
        snapshot_id=snapshot_id,
        written=0,
        skipped=0,
        conflicts=[],
        bytes_written=0,
        dry_run=False,
        already_restored=True,
    )


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
            shared=dict(plan.shared),
        )
    return RestoreReport(
        snapshot_id=manifest.id,
        written=writer.written,
        skipped=plan.skipped + writer.skipped,
        conflicts=sorted(plan.conflicts + writer.conflicts),
        bytes_written=writer.bytes_written,
        dry_run=False,
        shared=dict(plan.shared),
    )


# -- the restore entry points (each only picks a source) ---------------------------------
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
    return restore_snapshot(
        StoreSource(manifest, source),
        cache_dir,
        trusted_keys=trusted_keys,
        dry_run=dry_run,
        progress=progress,
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
    return restore_snapshot(
        TarSource(manifest, tar_stream),
        cache_dir,
        trusted_keys=trusted_keys,
        dry_run=dry_run,
        progress=progress,
    )


def restore_archive(
    path: Path,
    cache_dir: Path,
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
    trusted_keys: Sequence[TrustedKey] | None = None,
    manifest: Manifest | None = None,
) -> RestoreReport:
    """Restore a one-file archive (``snapshot.write_archive``) into ``cache_dir``.

    ``manifest``: the archive's manifest when the caller has read it already (the CLI
    checks its environment first), so the archive's first member is not parsed twice.
    """
    try:
        return restore_snapshot(
            ArchiveFileSource(Path(path), known_manifest=manifest),
            cache_dir,
            trusted_keys=trusted_keys,
            dry_run=dry_run,
            progress=progress,
        )
    except zstandard.ZstdError as exc:
        raise DigestMismatch(f"{path} is corrupt: {exc}") from exc


def merge_tree(src_dir: Path, dst_dir: Path) -> RestoreReport:
    """Merge ``src_dir`` into ``dst_dir`` under exactly the restore rules."""
    # Read relative to the scan's descriptors (cachekeeper.snapshot.scan): a file of ``src_dir``
    # swapped for a link, or rewritten, after it was hashed is refused, never followed.
    with CacheTree(Path(src_dir)) as tree:
        by_digest: dict[str, ScannedFile] = {}
        entries = []
        for scanned in tree.scan():
            with tree.reading(scanned) as fh:
                digest, size = hash_file(fh.fileno())
            by_digest.setdefault(digest, scanned)
            entries.append(
                FileEntry(path=scanned.rel, digest=digest, size_bytes=size, mode=scanned.mode)
            )
        manifest = Manifest(files=tuple(entries), fingerprint={})
        return restore_snapshot(
            StoreSource(manifest, DirSource(tree, by_digest)), dst_dir, merged=True
        )
