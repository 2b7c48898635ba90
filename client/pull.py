"""Pull the snapshot matching this node into a cache dir.

resolve (this node's fingerprint) -> lock the target dir -> already restored? done ->
fetch the manifest -> the digests the dir lacks -> one archive stream holding only those
-> ``restore_from_tar`` (which verifies every byte and renames files into place).

A download cut off mid-stream leaves only complete, verified files (the restore rules);
the pull then asks again for what is still needed, a bounded number of times and never
past the deadline. Many processes pulling into one dir: the first to take the dir's lock
fetches, the others wait on it and find the work done.
"""

from __future__ import annotations

import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from cachekeeper.errors import (
    BlobMissing,
    CachekeeperError,
    DigestMismatch,
    NoMatchingSnapshot,
    ServerError,
    ServerUnavailable,
)
from cachekeeper.fingerprint import format_mismatches
from cachekeeper.manifest import Manifest

from .api import CacheClient, Deadline, Resolution

if TYPE_CHECKING:
    from cachekeeper.signing import TrustedKey

__all__ = ["PullReport", "RestoreOutcome", "pull", "resolve_snapshot", "restore_snapshot"]

# Errors a rerun of the download can cure: a broken stream, a flaky server.
_RETRYABLE = (ServerUnavailable, ServerError, DigestMismatch, BlobMissing)


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "workload": self.workload,
            "cache_dir": self.cache_dir,
            "outcome": self.outcome,
            "exact": self.exact,
            "verified": self.verified,
            "blobs_fetched": self.blobs_fetched,
            "attempts": self.attempts,
            "conflicts": list(self.conflicts),
        }


@dataclass(frozen=True)
class RestoreOutcome:
    """What ``restore_snapshot`` did. ``outcome``: "restored" or "already_restored"."""

    outcome: str
    blobs_fetched: int = 0
    attempts: int = 0
    conflicts: tuple[str, ...] = ()


def resolve_snapshot(
    client: CacheClient,
    *,
    workload: str,
    fingerprint: dict[str, Any],
    driver_policy: str = "newer",
    devices: list[str] | None = None,
    deadline: Deadline | None = None,
) -> Resolution:
    """The server's best snapshot for this node; raises NoMatchingSnapshot naming the diff."""
    resolution = client.resolve(
        fingerprint,
        workload=workload,
        driver_policy=driver_policy,
        devices=devices,
        deadline=deadline,
    )
    if resolution.snapshot is None:
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
    return resolution


class _NoBlobs:
    """A restore source for a dir that already holds every blob (only the marker is due)."""

    def open(self, digest: str) -> BinaryIO:
        raise BlobMissing(f"blob {digest} was not fetched", extra={"missing": [digest]})


def restore_snapshot(
    client: CacheClient,
    snapshot_id: str,
    cache_dir: Path,
    *,
    deadline: Deadline | None = None,
    attempts: int = 3,
    trusted_keys: Sequence[TrustedKey] | None = None,
) -> RestoreOutcome:
    """Make ``cache_dir`` hold ``snapshot_id``, fetching only what it lacks.

    A file of the snapshot that exists with other content is kept (a conflict, reported);
    the rest of the snapshot is still restored. With ``trusted_keys`` (non-empty), the
    manifest's signature is checked before anything is downloaded or written
    (``SignatureInvalid`` otherwise), and the restore is all-or-nothing.
    """
    from cachekeeper.restore import (
        is_restored,
        needed_digests,
        restore,
        restore_from_tar,
        target_lock,
    )
    from cachekeeper.signing import verify_manifest

    key_ids = {k.key_id for k in trusted_keys or ()}
    cache_dir = Path(cache_dir)
    if key_ids:  # refuse before the target is touched at all
        manifest: Manifest = client.get_manifest(snapshot_id, deadline=deadline)
        verify_manifest(manifest, trusted_keys or ())
        if is_restored(snapshot_id, cache_dir, trusted_key_ids=key_ids):
            return RestoreOutcome("already_restored")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with target_lock(cache_dir):
        # another process may have done it while we waited
        if is_restored(snapshot_id, cache_dir, trusted_key_ids=key_ids):
            return RestoreOutcome("already_restored")
        if not key_ids:
            manifest = client.get_manifest(snapshot_id, deadline=deadline)
        fetched = 0
        last: CachekeeperError = ServerError(f"restore of {snapshot_id} did not complete")
        for attempt in range(1, attempts + 1):
            needed = needed_digests(manifest, cache_dir)
            try:
                if not needed:
                    report = restore(manifest, _NoBlobs(), cache_dir, trusted_keys=trusted_keys)
                else:
                    with client.open_archive(snapshot_id, needed, deadline=deadline) as stream:
                        report = restore_from_tar(
                            manifest, stream, cache_dir, trusted_keys=trusted_keys
                        )
                    fetched += len(needed)
                if report.conflicts or is_restored(snapshot_id, cache_dir, trusted_key_ids=key_ids):
                    return RestoreOutcome("restored", fetched, attempt, tuple(report.conflicts))
            except _RETRYABLE as exc:
                last = exc
            except (tarfile.TarError, EOFError) as exc:
                last = ServerUnavailable(f"archive of {snapshot_id} was cut off: {exc}")
            if deadline is not None and deadline.expired:
                break
        raise last


def pull(
    *,
    client: CacheClient,
    workload: str,
    cache_dir: Path,
    fingerprint: dict[str, Any] | None = None,
    driver_policy: str = "newer",
    devices: list[str] | None = None,
    deadline: Deadline | None = None,
    attempts: int = 3,
    trusted_keys: Sequence[TrustedKey] | None = None,
) -> PullReport:
    """Resolve this node's snapshot of ``workload`` and restore it into ``cache_dir``.

    With ``trusted_keys`` (non-empty), only a snapshot signed by one of them is restored.
    """
    from cachekeeper.fingerprint import collect

    fp = fingerprint if fingerprint is not None else collect()
    resolution = resolve_snapshot(
        client,
        workload=workload,
        fingerprint=fp,
        driver_policy=driver_policy,
        devices=devices,
        deadline=deadline,
    )
    snapshot_id = resolution.snapshot_id
    assert snapshot_id is not None
    done = restore_snapshot(
        client,
        snapshot_id,
        Path(cache_dir),
        deadline=deadline,
        attempts=attempts,
        trusted_keys=trusted_keys,
    )
    return PullReport(
        snapshot_id=snapshot_id,
        workload=workload,
        cache_dir=str(cache_dir),
        outcome=done.outcome,
        exact=resolution.exact,
        verified=resolution.verified,
        blobs_fetched=done.blobs_fetched,
        attempts=done.attempts,
        conflicts=done.conflicts,
    )
