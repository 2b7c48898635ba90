"""GC of the server's blobs and snapshots: plan, re-check under the write lock, execute.

``Collector.plan`` reads the catalog and the backend and decides, touching nothing
(``POST /v1/gc`` with ``dry_run`` answers the plan): least recently used unpinned
snapshots are evicted until the stored bytes fit ``max_store_bytes`` (or a given target),
then every blob no kept snapshot references goes, when an evicted snapshot did or it was
last used more than ``gc_grace_s`` ago (an upload waiting for its publish survives), and
so do files with no row (orphans) and archive objects with no snapshot (direct access),
once older than ``gc_grace_s``. What the grace period keeps is in the plan too.

``Collector.execute`` carries a plan out in one catalog transaction: first every decision
is **re-checked under the write lock** (a snapshot pinned since the plan stays; a blob row
used since ``planned_at``, or referenced again, stays; an orphan that got a row, or is
newer now, stays) and the rows that still go are deleted; then, after the commit and still
under the lock, the **bytes** go: blob files and archive objects. Rows (pointers) are
removed before the bytes, and an upload records its row under the same lock after
checking that its file is there (``Blobs.put``), so it never records a row for a
file about to be deleted. The answer is what was done, not what was planned.

Uploads never evict: the cap against uploads (``max_store_bytes``) is ``server/capacity.py``'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from cachekeeper.backends.base import BlobBackend, DirectAccess
from cachekeeper.server.catalog import Catalog, Transaction
from cachekeeper.server.settings import Settings
from cachekeeper.wire import utc_now

from .blobs import blob_last_access, blob_usage, delete_unused_blob_rows
from .snapshots import (
    add_event,
    delete_snapshot,
    lru_unpinned,
    snapshot_blobs,
    snapshot_exists,
    summary,
)

__all__ = ["Collector", "GcPlan"]


@dataclass(frozen=True)
class GcPlan:
    """What a GC run deletes; ``Collector.execute`` carries it out."""

    snapshots_evicted: tuple[str, ...]
    blobs: tuple[str, ...]
    bytes_freed: int
    orphan_files: tuple[str, ...] = field(default=())
    planned_at: str = ""  # blob rows used after this are kept by the execution
    # Archive objects (object store) whose snapshot is gone: evicted, deleted, or a
    # publish refused after its archive was written. Named by snapshot id.
    orphan_archives: tuple[str, ...] = field(default=())
    # Unreferenced blob rows kept because they were used less than gc_grace_s ago (an
    # upload waiting for its publish, or a snapshot just removed): a GC after
    # ``grace_ends_at`` frees them, unless a snapshot references them again.
    in_grace: tuple[str, ...] = field(default=())
    in_grace_bytes: int = 0
    grace_ends_at: str | None = None


class Collector:
    """GC over the snapshots' blobs: the catalog, the blob backend and its direct access.

    ``settings`` is read at each run (``max_store_bytes``, ``gc_grace_s``), not copied.
    """

    def __init__(
        self,
        *,
        catalog: Catalog,
        blobs: BlobBackend,
        direct: DirectAccess | None,
        settings: Settings,
    ) -> None:
        self.catalog = catalog
        self.blobs = blobs
        self.direct = direct
        self.settings = settings
        self.evictions = 0  # snapshots evicted by GC since start (for /metrics)

    def plan(self, *, target_bytes: int | None = None) -> GcPlan:
        """What a GC would delete now (see the module docstring); touches nothing.

        ``target_bytes`` defaults to ``max_store_bytes`` (no eviction when unlimited).
        """
        target = self.settings.max_store_bytes if target_bytes is None else target_bytes
        planned_at = utc_now()
        usage = blob_usage(self.catalog)
        refs = {u.digest: u.refs for u in usage}
        stored = {u.digest: u.stored_bytes for u in usage}
        cutoff = _iso_ago(self.settings.gc_grace_s)
        dead = {u.digest for u in usage if u.refs == 0 and u.last_access_at < cutoff}
        waiting = [u for u in usage if u.refs == 0 and u.last_access_at >= cutoff]
        total = sum(stored.values())
        freed = sum(stored[d] for d in dead)
        evicted: list[str] = []
        if target is not None and total - freed > target:
            for snapshot_id in lru_unpinned(self.catalog):
                if total - freed <= target:
                    break
                evicted.append(snapshot_id)
                for digest in snapshot_blobs(self.catalog, snapshot_id):
                    refs[digest] -= 1
                    if refs[digest] == 0 and digest not in dead:
                        dead.add(digest)
                        freed += stored[digest]
        too_new = time.time() - self.settings.gc_grace_s
        orphans = [
            s for s in self.blobs.scan() if s.digest not in stored and s.modified_at < too_new
        ]
        freed += sum(s.stored_bytes for s in orphans)
        archives: list[str] = []
        if self.direct is not None:
            for found in self.direct.archives():
                if found.digest in evicted or (
                    found.modified_at < too_new and not summary(self.catalog, found.digest)
                ):
                    archives.append(found.digest)
                    freed += found.stored_bytes
        waiting = [u for u in waiting if u.digest not in dead]  # eviction frees them now
        return GcPlan(
            tuple(evicted),
            tuple(sorted(dead)),
            freed,
            tuple(s.digest for s in orphans),
            planned_at=planned_at,
            orphan_archives=tuple(archives),
            in_grace=tuple(sorted(u.digest for u in waiting)),
            in_grace_bytes=sum(u.stored_bytes for u in waiting),
            grace_ends_at=_iso_after(
                max((u.last_access_at for u in waiting), default=None), self.settings.gc_grace_s
            ),  # fmt: skip
        )

    def execute(self, plan: GcPlan) -> GcPlan:
        """Carry out ``plan``: re-check and delete rows under the write lock, then the bytes
        after the commit, still under it; returns what was done."""
        with self.catalog.writing() as tx:
            done = self._recheck(tx, plan)
            tx.after_commit(lambda: self._delete_bytes(done))
        self.evictions += len(done.snapshots_evicted)
        return done

    def _recheck(self, tx: Transaction, plan: GcPlan) -> GcPlan:
        """(under the write lock) Delete the rows whose decision still holds; the plan of
        what goes. A snapshot is evicted only if still unpinned; a blob row goes only if
        nothing references it and it was not used since ``plan.planned_at``; an orphan
        file only if it still has no row and is still older than ``gc_grace_s``; an archive
        object only if no snapshot row names it."""
        evicted: list[str] = []
        orphans: list[str] = []
        too_new = time.time() - self.settings.gc_grace_s
        for snapshot_id in plan.snapshots_evicted:
            if delete_snapshot(tx, snapshot_id, only_unpinned=True):
                add_event(tx, kind="snapshot.evicted", subject=snapshot_id, detail=None)
                evicted.append(snapshot_id)
        freed = delete_unused_blob_rows(tx, plan.blobs, unused_since=plan.planned_at)
        for digest in plan.orphan_files:
            stat = self.blobs.stat(digest)
            if blob_last_access(tx, digest) is None and stat and stat.modified_at < too_new:
                orphans.append(digest)
                freed[digest] = stat.stored_bytes
        archives = [a for a in plan.orphan_archives if not snapshot_exists(tx, a)]
        return replace(
            plan,
            snapshots_evicted=tuple(evicted),
            blobs=tuple(sorted(d for d in freed if d not in orphans)),
            bytes_freed=sum(freed.values()),
            orphan_files=tuple(orphans),
            orphan_archives=tuple(archives),
        )

    def _delete_bytes(self, done: GcPlan) -> None:
        """(after the commit, under the lock) The bytes of what ``_recheck`` kept in ``done``."""
        for digest in (*done.blobs, *done.orphan_files):
            self.blobs.delete(digest)
        if self.direct is not None:
            for snapshot_id in done.orphan_archives:
                self.direct.delete_archive(snapshot_id)


def _iso_ago(seconds: float) -> str:
    return (datetime.now(UTC) - timedelta(seconds=seconds)).isoformat(timespec="microseconds")


def _iso_after(at: str | None, seconds: float) -> str | None:
    if not at:
        return None
    return (datetime.fromisoformat(at) + timedelta(seconds=seconds)).isoformat(timespec="seconds")
