"""Pull the snapshot matching this node into a cache dir.

resolve (this node's fingerprint) -> ``cachekeeper.restore.restore_snapshot`` with the
server as its source: the manifest, and one archive stream holding only the blobs the
dir still needs. The restore owns the rest (lock, already-restored check, signature,
verified writes, marker); this module only supplies the bytes, and retries.

A download cut off mid-stream leaves only complete, verified files (the restore rules);
the pull then asks again for what is still needed, a bounded number of times and never
past the deadline. Many processes pulling into one dir: the first to take the dir's lock
fetches, the others wait on it and find the work done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

from cachekeeper.environment.fingerprint import Fingerprint, collect, format_mismatches
from cachekeeper.errors import (
    CachekeeperError,
    NoMatchingSnapshot,
    ServerError,
)
from cachekeeper.restore import restore_snapshot
from cachekeeper.restore.sources import Blobs, archive_blobs
from cachekeeper.snapshot.archive import read_manifest_member
from cachekeeper.snapshot.manifest import FileEntry, Manifest
from cachekeeper.snapshot.signing import TrustedKey
from cachekeeper.wire import to_dict

from .api import CacheClient, Deadline, Resolution
from .direct import DirectUnavailable, ObjectStore

__all__ = ["PullReport", "pull", "require_snapshot", "resolve_snapshot"]


@dataclass(frozen=True)
class PullReport:
    """What a pull did. ``outcome`` is "restored" or "already_restored"."""

    snapshot_id: str
    workload: str
    cache_dir: str
    outcome: str
    exact: bool
    verified: bool
    blobs_fetched: int
    attempts: int
    conflicts: tuple[str, ...] = ()  # paths kept as they were (see cachekeeper.restore)
    archive_from: str = "server"  # "object_store" when the bytes came from a presigned URL
    fallback_reason: str | None = None  # why a presigned download was given up for the server
    deltas: tuple[str, ...] = ()  # harvested deltas restored (or already there) after it
    delta_problems: tuple[str, ...] = ()  # deltas not restored, one line each (why)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def resolve_snapshot(
    client: CacheClient,
    *,
    workload: str,
    fingerprint: Fingerprint,
    driver_policy: str = "newer",
    devices: list[str] | None = None,
    deadline: Deadline | None = None,
    trusted_keys: Sequence[TrustedKey] | None = None,
) -> Resolution:
    """The server's best snapshot for this node (signed by one of ``trusted_keys`` when
    given); raises NoMatchingSnapshot naming the diff."""
    resolution = client.resolve(
        fingerprint,
        workload=workload,
        driver_policy=driver_policy,
        devices=devices,
        deadline=deadline,
        trusted_keys=trusted_keys,
    )
    return require_snapshot(resolution, workload=workload)


def require_snapshot(resolution: Resolution, *, workload: str) -> Resolution:
    """``resolution`` when it names a snapshot; else NoMatchingSnapshot with the nearest diff."""
    if resolution.snapshot is not None:
        return resolution
    detail = resolution.reason or f"no snapshot of workload {workload!r} matches this node"
    nearest = next((n for n in resolution.near_misses if n.mismatches), None)
    if nearest is not None:
        detail += f"; nearest differs: {format_mismatches(list(nearest.mismatches))}"
    raise NoMatchingSnapshot(
        detail,
        extra={
            "near_misses": [
                {"snapshot": n.snapshot_id, "mismatches": [m.to_dict() for m in n.mismatches]}
                for n in resolution.near_misses
            ]
        },
    )


class _ServerSnapshot:
    """The server as a restore source: its manifest, and archive streams of blobs.

    With an ``archive_url`` (the server's blobs are in an object store), the archive comes
    from there; once that fails (refused, expired, cut off), this and every later attempt
    use the server's archive route instead, and ``fallback_reason`` says why.
    """

    def __init__(
        self,
        client: CacheClient,
        snapshot_id: str,
        deadline: Deadline | None,
        *,
        archive_url: str | None = None,
        objects: ObjectStore | None = None,
    ) -> None:
        self.client = client
        self.snapshot_id = snapshot_id
        self.deadline = deadline
        self.archive_url = archive_url
        self.objects = objects
        self.blobs_fetched = 0
        self.fetched_manifest: Manifest | None = None
        self.archive_from = "server"
        self.fallback_reason: str | None = None
        self._opened: BinaryIO | None = None  # the archive stream, manifest read from it
        self._direct_used = False  # an attempt read blobs from the object store

    def manifest(self) -> Manifest:
        if self.fetched_manifest is None:
            self.fetched_manifest = self._direct_manifest() or self.client.get_manifest(
                self.snapshot_id, deadline=self.deadline
            )
        return self.fetched_manifest

    def _direct_manifest(self) -> Manifest | None:
        """The manifest from the archive object's first member, keeping the stream open for
        ``open_blobs`` (one download, and the server sends no manifest); None on failure."""
        stream = self._open_direct()
        if stream is None:
            return None
        try:
            found = read_manifest_member(stream, source="the object store's archive")
            if found.id != self.snapshot_id:
                raise DirectUnavailable(f"its manifest is {found.id}, not {self.snapshot_id}")
        except Exception as exc:  # any failure of the store's bytes: ask the server
            stream.close()
            self.fallback_reason = f"the object store's archive failed: {exc}"
            self.archive_url = None
            return None
        self._opened = stream
        return found

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None

    def after_failure(self, exc: Exception) -> None:
        """A restore attempt failed: when its bytes came from the object store, the next
        attempt takes them from the server. (A small blob's bytes are checked by the
        restore's writer threads after the stream ended, so a corrupt archive object can
        fail an attempt outside ``open_blobs``.)"""
        if self._direct_used and self.archive_url is not None:
            self.fallback_reason = f"the object store's archive failed: {exc}"
            self.archive_url = None

    @contextlib.contextmanager
    def open_blobs(self, needed: Mapping[str, Sequence[FileEntry]]) -> Iterator[Blobs]:
        direct, self._opened = self._opened or self._open_direct(), None
        if direct is not None:
            self._direct_used = True
            try:
                with contextlib.closing(direct) as tar:
                    yield archive_blobs(self.manifest(), tar)
            except Exception as exc:  # any failure of the store's bytes: the server's next time
                self.fallback_reason = f"the object store's archive failed: {exc}"
                self.archive_url = None
                raise
            self.archive_from = "object_store"
        else:
            with self.client.open_archive(
                self.snapshot_id, set(needed), deadline=self.deadline
            ) as tar:
                yield archive_blobs(self.manifest(), tar)
            self.archive_from = "server"
        self.blobs_fetched += len(needed)

    def _open_direct(self) -> BinaryIO | None:
        """The archive's stream from the object store, or None (none offered, or refused)."""
        if self.archive_url is None or self.objects is None:
            return None
        try:
            return self.objects.open_archive(self.archive_url, deadline=self.deadline)
        except DirectUnavailable as exc:
            self.fallback_reason = str(exc)
            self.archive_url = None
            return None


def pull(
    *,
    client: CacheClient,
    workload: str,
    cache_dir: Path,
    fingerprint: Fingerprint | None = None,
    driver_policy: str = "newer",
    devices: list[str] | None = None,
    deadline: Deadline | None = None,
    attempts: int = 3,
    trusted_keys: Sequence[TrustedKey] | None = None,
    on_resolved: Callable[[str], None] | None = None,
    objects: ObjectStore | None = None,
    resolution: Resolution | None = None,
) -> PullReport:
    """Resolve this node's snapshot of ``workload`` and restore it into ``cache_dir``.

    Only what the dir lacks is fetched. A file of the snapshot that exists with other
    content is kept (a conflict, reported); the rest is still restored. With
    ``trusted_keys`` (non-empty), the server is asked for a snapshot signed by one of them
    and only such a snapshot is restored: the signature is checked again here before
    anything is downloaded or written (``SignatureInvalid`` otherwise), and the restore is
    all-or-nothing. ``on_resolved`` is told the snapshot
    id as soon as it is known (the hook reports it even when the restore then fails).
    When the server offers a presigned archive URL, the bytes come from the object store
    through ``objects`` (one is made when not given; the test seam), else from the server.
    ``resolution``: the server's answer to this node's resolve when the caller already has
    it (the pre-job hook asks once, for its no-op check); None: resolve here.
    """
    if resolution is not None:
        resolution = require_snapshot(resolution, workload=workload)
    else:
        resolution = resolve_snapshot(
            client,
            workload=workload,
            fingerprint=fingerprint if fingerprint is not None else collect(),
            driver_policy=driver_policy,
            devices=devices,
            deadline=deadline,
            trusted_keys=trusted_keys,
        )
    snapshot_id = resolution.snapshot_id
    assert snapshot_id is not None
    if on_resolved is not None:
        on_resolved(snapshot_id)
    with contextlib.ExitStack() as stack:
        if resolution.archive_url is not None and objects is None:
            objects = stack.enter_context(ObjectStore(timeout_s=client.timeout_s))
        source = _ServerSnapshot(
            client, snapshot_id, deadline, archive_url=resolution.archive_url, objects=objects
        )
        stack.callback(source.close)
        report = _restore(source, resolution, workload, cache_dir, attempts, trusted_keys)
    if not resolution.deltas:
        return report
    return _restore_deltas(
        report, client, resolution, workload, cache_dir, attempts, trusted_keys, deadline
    )


def _restore_deltas(
    report: PullReport,
    client: CacheClient,
    resolution: Resolution,
    workload: str,
    cache_dir: Path,
    attempts: int,
    trusted_keys: Sequence[TrustedKey] | None,
    deadline: Deadline | None,
) -> PullReport:
    """Restore the harvested deltas after the snapshot, by the same restore and rules.

    A delta that cannot be restored (unsigned under a trust list, cut off, conflicting) is
    one line in ``delta_problems``; the snapshot restored before it stands.
    """
    done: list[str] = []
    problems: list[str] = []
    fetched = report.blobs_fetched
    for delta in resolution.deltas:
        if deadline is not None and deadline.expired:
            problems.append(f"{delta.id[:12]}: out of time")
            continue
        source = _ServerSnapshot(client, delta.id, deadline)
        try:
            got = _restore(source, resolution, workload, cache_dir, attempts, trusted_keys)
        except CachekeeperError as exc:
            problems.append(f"{delta.id[:12]}: {exc.detail}")
            continue
        fetched += got.blobs_fetched
        if got.conflicts:
            problems.append(f"{delta.id[:12]}: {len(got.conflicts)} file(s) kept as they were")
        done.append(delta.id)
    return replace(
        report, deltas=tuple(done), delta_problems=tuple(problems), blobs_fetched=fetched
    )


def _restore(
    source: _ServerSnapshot,
    resolution: Resolution,
    workload: str,
    cache_dir: Path,
    attempts: int,
    trusted_keys: Sequence[TrustedKey] | None,
) -> PullReport:
    """Restore with up to ``attempts`` tries of the download (a cut-off stream is retried)."""
    snapshot_id = source.snapshot_id
    deadline = source.deadline
    last: CachekeeperError = ServerError(f"restore of {snapshot_id} did not complete")
    for attempt in range(1, attempts + 1):
        try:
            report = restore_snapshot(
                source, Path(cache_dir), trusted_keys=trusted_keys, reuse_marker=True
            )
        except CachekeeperError as exc:
            # What a rerun of the download can cure (a broken stream, a flaky server,
            # damaged bytes: cachekeeper.errors' retryable); not the manifest itself, which
            # the client's transport retried already.
            if not exc.retryable or source.fetched_manifest is None:
                raise
            source.after_failure(exc)
            last = exc
        else:
            return PullReport(
                snapshot_id=snapshot_id,
                workload=workload,
                cache_dir=str(cache_dir),
                outcome="already_restored" if report.already_restored else "restored",
                exact=resolution.exact,
                verified=resolution.verified,
                blobs_fetched=source.blobs_fetched,
                attempts=0 if report.already_restored else attempt,
                conflicts=tuple(report.conflicts),
                archive_from=source.archive_from,
                fallback_reason=source.fallback_reason,
            )
        if deadline is not None and deadline.expired:
            break
    raise last
