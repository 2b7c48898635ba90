"""The one storage interface the routes use: ``Storage``.

``Storage`` joins two things: the metadata ``Catalog`` (SQLite, all SQL in
``server/catalog/``) and a ``BlobBackend`` holding the blob bytes (``cachekeeper/backends/base.py``:
the local directory by default, or the object store; ``server/app.py`` ``open_backend``
picks it). Storage asks the backend for its direct access once and never for its class.
What this module adds on top: the upload size limit, publishing a manifest (packing it
first when the backend has direct access, ``server/packing.py``), resolve, and GC
(``server/resources/gc.py``: plan, re-check under the lock, execute; it evicts LRU snapshots down to
the hard cap, which uploads never do, see ``capacity.StoreRoom``). Routes call one method
each and never see the catalog or the backend. Every write of rows a client sends is
checked against its table's budget in the same transaction (``server/budgets.py``), and
a retention pass runs at start-up and at most once a minute before such a write.

Ordering rules that keep a crash harmless: a blob's row is written only after the blob
store made the file visible (a crash before leaves at most a temp file, or a file with no
row that GC removes); a snapshot row appears in one transaction after every blob it names
has a row; deletion removes rows (pointers) before files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, BinaryIO

from cachekeeper.server.archive import archive_chunks
from cachekeeper.server.budgets import Budgets, event_bytes, report_bytes
from cachekeeper.server.catalog import Catalog, agent_id_for
from cachekeeper.server.packing import Packed, SnapshotLocks, pack_snapshot, record_checked
from cachekeeper.server.records import Counts
from cachekeeper.server.settings import Settings
from cachekeeper.server.trust import NodeTrust, Verdicts

from cachekeeper import remote_tier
from cachekeeper.backends.base import BlobBackend, DirectAccess, PutResult
from cachekeeper.errors import (
    AgentNotFound,
    BlobMissing,
    InvalidManifest,
    PayloadTooLarge,
    ServerUnavailable,
    SnapshotNotFound,
    WorkloadNotFound,
)
from cachekeeper.fingerprint import DriverPolicy, Fingerprint
from cachekeeper.manifest import Manifest
from cachekeeper.signing import TrustedKey
from cachekeeper.wire import (
    AgentInfo,
    EventOut,
    JobReport,
    ResolveAnswer,
    StatusRow,
    Summary,
    Upload,
    WorkloadInfo,
    utc_now,
)

from .fleet import fleet_status
from .gc import Collector, GcPlan
from .resolve import miss_reason, rank, unknown_workload

__all__ = ["CheckReport", "Storage", "StoredBlob", "limit_size"]


def limit_size(chunks: Iterable[bytes], *, max_bytes: int, what: str) -> Iterator[bytes]:
    """Pass ``chunks`` through, raising PayloadTooLarge once more than ``max_bytes`` went by."""
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > max_bytes:
            raise PayloadTooLarge(f"{what} is over the server's limit of {max_bytes} bytes")
        yield chunk


@dataclass(frozen=True)
class StoredBlob:
    digest: str
    size_bytes: int  # uncompressed
    stored_bytes: int  # as stored


@dataclass(frozen=True)
class CheckReport:
    """What ``Storage.check`` changed at start-up."""

    stale_blob_rows: int  # rows dropped: their bytes were gone
    completed: tuple[str, ...]  # snapshots whose missing references were added
    quarantined: tuple[str, ...]  # snapshots taken out of service: blobs are gone


class Storage:
    """The server's store: a blob backend plus the metadata catalog."""

    def __init__(self, *, settings: Settings, catalog: Catalog, blobs: BlobBackend) -> None:
        self.settings = settings
        self.catalog = catalog
        self.blobs = blobs
        # Asked once: the object store's URLs and archive objects, None for a local dir.
        self.direct: DirectAccess | None = blobs.direct_access()
        self.evictions = 0  # snapshots evicted by GC since start (for /metrics)
        self.packs = 0  # archive objects packed by publish since start (for /metrics)
        self._publishing = SnapshotLocks()  # one publish of a snapshot at a time (packing.py)
        self.budgets = Budgets(settings)  # the client-written tables' bounds and retention
        self._gc = Collector(catalog=catalog, blobs=blobs, direct=self.direct, settings=settings)
        self._verdicts = Verdicts()  # signature checks for nodes' trusted keys (server/trust.py)

    # -- blobs ------------------------------------------------------------------------
    def missing_blobs(self, digests: Iterable[str]) -> list[str]:
        """Which of ``digests`` the server does not have, in the order given: no row, or a
        row whose bytes are gone (so a push uploads it again rather than skip it)."""
        wanted = list(dict.fromkeys(digests))
        present = self.catalog.blob_sizes(wanted)
        return [d for d in wanted if d not in present or self.blobs.stat(d) is None]

    def upload_targets(self, digests: Iterable[str]) -> list[Upload]:
        """Where nodes PUT ``digests`` themselves (direct access); else none: they upload
        through the server. Publish hashes what they uploaded regardless."""
        if self.direct is None:
            return []
        expires = self.settings.presign_expires_s
        return [self.direct.upload_target(d, expires_s=expires) for d in digests]

    def archive_url(self, snapshot_id: str) -> str | None:
        """Where nodes GET the snapshot's archive object (direct access only)."""
        if self.direct is None:
            return None
        return self.direct.archive_url(snapshot_id, expires_s=self.settings.presign_expires_s)

    def blob(self, digest: str) -> StoredBlob | None:
        """The blob's sizes when both its row and its bytes are there."""
        info = self.catalog.blob_info(digest)
        stat = self.blobs.stat(digest)
        if info is None or stat is None:
            return None
        return StoredBlob(digest, info.size_bytes, stat.stored_bytes)

    def has_blob_bytes(self, digest: str) -> bool:
        """Whether the backend holds the blob's bytes (row or not)."""
        return self.blobs.stat(digest) is not None

    def store_bytes(self) -> int:
        """Stored (compressed) bytes of every blob with a row: what the cap counts."""
        return self.catalog.store_bytes()

    def open_blob(self, digest: str) -> BinaryIO:
        return self.blobs.open(digest)

    def open_blob_raw(self, digest: str) -> BinaryIO:
        return self.blobs.open_raw(digest)

    def put_blob(self, digest: str, chunks: Iterable[bytes]) -> PutResult:
        """Store the uncompressed ``chunks`` as blob ``digest`` (hash-checked), then its row."""
        limited = limit_size(chunks, max_bytes=self.settings.max_blob_bytes, what="blob")
        result = self.blobs.put(limited, digest=digest)
        collected = ServerUnavailable(f"blob {digest} was collected while uploading; retry")
        size = result.size_bytes
        if not result.created:
            info = self.catalog.blob_info(digest)
            try:
                size = info.size_bytes if info else _uncompressed_size(self.blobs, digest)
            except BlobMissing as exc:
                raise collected from exc
        with self.catalog.writing() as tx:
            # GC deletes files only under this lock: the file seen here stays with its row.
            stat = self.blobs.stat(digest)
            if stat is None:
                raise collected
            tx.record_blob(digest=digest, size_bytes=size, stored_bytes=stat.stored_bytes)
        return PutResult(digest, size, stat.stored_bytes, result.created)

    # -- snapshots --------------------------------------------------------------------
    def snapshot(self, snapshot_id: str) -> Summary:
        found = self.catalog.summary(snapshot_id)
        if found is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id} on this server")
        return found

    def list_snapshots(
        self,
        *,
        workload: str | None = None,
        fingerprint_digest: str | None = None,
        verified: bool | None = None,
        limit: int = 1000,
    ) -> list[Summary]:
        return self.catalog.list_summaries(
            workload=workload, fingerprint_digest=fingerprint_digest, verified=verified, limit=limit
        )

    def manifest_text(self, snapshot_id: str) -> str:
        """The manifest JSON as published (signature included)."""
        text = self.catalog.manifest_text(snapshot_id)
        if text is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id} on this server")
        return text

    def archive(
        self,
        snapshot_id: str,
        *,
        digests: Iterable[str] | None = None,
        on_blob: Callable[[str], None] | None = None,
    ) -> Iterator[bytes]:
        """The snapshot (or only ``digests`` of it) as one archive stream; marks it used."""
        text = self.manifest_text(snapshot_id)
        sizes = self.catalog.snapshot_blobs(snapshot_id)
        order = list(dict.fromkeys(f["digest"] for f in json.loads(text)["files"]))
        if digests is not None:
            chosen = set(digests)
            order = [d for d in order if d in chosen]
        with self.catalog.writing() as tx:
            tx.touch_snapshot(snapshot_id)
        direct = self.direct
        if direct is not None and len(order) == len(sizes):
            # The whole snapshot: its archive object as written at publish (no recompression),
            # unless it was changed behind our back: then the stream is built from the blobs.
            if self._archive_intact(direct, snapshot_id):
                return _read_chunks(direct.open_archive(snapshot_id))
        return archive_chunks(
            manifest_json=text.encode(),
            blobs=[(d, sizes[d]) for d in order],
            store=self.blobs,
            level=self.settings.archive_level,
            on_blob=on_blob,
        )

    def node_trust(self, keys: list[TrustedKey]) -> NodeTrust:
        """A node's trust (the public keys it sent), checked against stored manifests."""
        return NodeTrust(keys, manifest_text=self.catalog.manifest_text, verdicts=self._verdicts)

    def resolve(
        self,
        *,
        fingerprint: Fingerprint,
        workload: str | None,
        driver_policy: DriverPolicy = "newer",
        devices: list[str] | None = None,
        trust: NodeTrust | None = None,
    ) -> ResolveAnswer:
        """The best snapshot for a node (see ``server.resolver``); marks the hit used.

        With ``trust`` (the node's keys), only a snapshot whose signature the server
        checked against one of them ranks, and only such deltas are offered after it.
        """
        candidates = self.catalog.candidates(workload)
        found = rank(
            candidates,
            fingerprint=fingerprint,
            driver_policy=driver_policy,
            devices=devices,
            vouch=None if trust is None else trust.problem,
            trusted_key_ids=() if trust is None else trust.key_ids,
        )
        if found.snapshot is None:
            unknown = None if candidates or workload is None else self.unknown_workload(workload)
            untrusted = any(
                [m.field for m in near.mismatches] == ["signature"] for near in found.near_misses
            )
            reason = miss_reason(
                workload, has_snapshots=bool(candidates), unknown=unknown, untrusted=untrusted
            )
            return replace(found, reason=reason)
        with self.catalog.writing() as tx:
            tx.touch_snapshot(found.snapshot.id)
        hit = found.snapshot
        if trust is not None:
            found = replace(found, signed_by=trust.verdict(hit).key_id)
        url = self.archive_url(hit.id)
        if url is not None:
            found = replace(found, archive_url=url)
        if not self.settings.serve_harvested:
            return found
        deltas = self.catalog.harvested_deltas(hit.id, fingerprint_digest=hit.fingerprint_digest)
        if trust is not None:  # offered to a trusting node only when its keys signed them
            deltas = [d for d in deltas if trust.problem(d) is None]
        return replace(found, deltas=tuple(deltas))

    def resolve_for_job(
        self,
        *,
        fingerprint: Fingerprint,
        switches: Mapping[str, str],
        workload: str | None,
        driver_policy: DriverPolicy = "newer",
        devices: list[str] | None = None,
        trust: NodeTrust | None = None,
    ) -> tuple[ResolveAnswer, dict[str, str]]:
        """``resolve`` for a job that will export the per-key tier's ``switches``: ranked
        for the environment the job runs in (``remote_tier.with_key_switches``). A snapshot
        built before the tier was on (without the key-relevant switches) still serves it:
        then the job runs without them. (answer, the switches the job must export)."""
        keyed = remote_tier.key_switches(switches)
        answer = self.resolve(
            fingerprint=remote_tier.with_key_switches(fingerprint, keyed),
            workload=workload,
            driver_policy=driver_policy,
            devices=devices,
            trust=trust,
        )
        if answer.snapshot is not None or not keyed:
            return answer, dict(switches)
        older = self.resolve(
            fingerprint=remote_tier.with_key_switches(fingerprint, {}),
            workload=workload,
            driver_policy=driver_policy,
            devices=devices,
            trust=trust,
        )
        if older.snapshot is None:
            return answer, dict(switches)
        return older, {k: v for k, v in switches.items() if k not in keyed}

    def set_pinned(self, snapshot_id: str, *, pinned: bool) -> Summary:
        with self.catalog.writing() as tx:
            if not tx.set_pinned(snapshot_id, pinned=pinned):
                raise SnapshotNotFound(f"no snapshot {snapshot_id} on this server")
        return self.snapshot(snapshot_id)

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot (pointers only); blobs no other snapshot uses go at the next GC."""
        with self.catalog.writing() as tx:
            if not tx.delete_snapshot(snapshot_id):
                raise SnapshotNotFound(f"no snapshot {snapshot_id} on this server")

    def publish(self, manifest: Manifest) -> tuple[Summary, bool]:
        """Record ``manifest`` as a snapshot; (summary, created). Idempotent by id.

        One transaction: the snapshot row, every blob reference and the event appear
        together or not at all. Publishing a snapshot that exists completes it if it lacks
        references (a half-published row left by an older server) and keeps a signature
        it did not have; it answers ``created`` False. A publish of a snapshot being
        published waits for that one (a client retrying a slow publish packs nothing twice).
        """
        self.prune()  # the audit log grows with publishes
        with self._publishing.hold(manifest.id):
            return self._publish(manifest)

    def _publish(self, manifest: Manifest) -> tuple[Summary, bool]:
        snapshot_id = manifest.id
        with self.catalog.writing() as tx:  # refused before packing, not after
            self.budgets.admit_snapshot(tx, manifest)
        checked = self._pack(manifest)
        sizes = checked.sizes if checked is not None else self.catalog.blob_sizes(manifest.digests)
        missing = sorted(manifest.digests - sizes.keys())
        if missing:
            raise BlobMissing(
                f"{len(missing)} blob(s) of snapshot {snapshot_id[:12]} are not on the server",
                extra={"missing": missing},
            )
        for entry in manifest.files:
            if sizes[entry.digest] != entry.size_bytes:
                raise InvalidManifest(
                    f"{entry.path}: size_bytes {entry.size_bytes} does not match blob"
                    f" {entry.digest[:12]} ({sizes[entry.digest]} bytes)"
                )
        with self.catalog.writing() as tx:
            if checked is not None and self.direct is not None:  # packed: direct access
                record_checked(tx, self.direct, checked, grace_s=self.settings.gc_grace_s)
                tx.record_archive(
                    snapshot_id, etag=checked.archive_etag, size_bytes=checked.archive_bytes
                )
            # A GC may have run since the check above: re-check inside the transaction.
            created = not tx.snapshot_exists(snapshot_id)
            absent = set(manifest.digests)
            if not created:
                absent -= tx.referenced_digests(snapshot_id)
            still = tx.missing_blob_rows(absent)
            if still:
                raise BlobMissing(
                    f"{len(still)} blob(s) of snapshot {snapshot_id[:12]} were collected",
                    extra={"missing": still},
                )
            if created:
                self.budgets.admit_snapshot(tx, manifest)
                tx.insert_snapshot(manifest, created_at=utc_now())
            else:
                if manifest.signature is not None:
                    # The same snapshot, now signed: keep the signature (the id is unchanged).
                    tx.sign_snapshot(snapshot_id, manifest_json=manifest.to_json())
                if absent:
                    tx.add_references(snapshot_id, absent, at=utc_now())
                    tx.add_event(kind="snapshot.completed", subject=snapshot_id, detail=len(absent))
        return self.snapshot(snapshot_id), created

    def _pack(self, manifest: Manifest) -> Packed | None:
        """Direct access: hash every blob there and write the archive object; else None.

        Skipped (None) for a snapshot published before whose archive object is there as
        this server wrote it (``_archive_intact``) and whose manifest does not change (a
        re-push); a newly added signature rewrites it, and so does an archive object that
        is gone or was changed behind the server's back: the re-push repairs it.
        """
        if self.direct is None:
            return None
        existing = self.catalog.summary(manifest.id)
        if existing is not None and self._archive_intact(self.direct, manifest.id):
            if manifest.signature is None or existing.signed:
                return None
        packed = pack_snapshot(
            self.direct,
            manifest,
            tmp_dir=self.settings.data_dir / "tmp",
            level=self.settings.archive_level,
        )
        self.packs += 1
        return packed

    def _archive_intact(self, direct: DirectAccess, snapshot_id: str) -> bool:
        """Whether the snapshot's archive object is the one this server wrote (its ETag)."""
        recorded = self.catalog.archive_etag(snapshot_id)
        return recorded is not None and direct.archive_etag(snapshot_id) == recorded

    def check(self) -> CheckReport:
        """The start-up check: make every row agree with what is stored.

        Blob rows whose bytes are gone are dropped. A snapshot that references fewer blobs
        than its manifest names (a publish cut short by an older server) is completed when
        every blob is there, and quarantined otherwise (``quarantine`` table; a re-push of
        the same manifest publishes it again). One transaction.
        """
        present = {s.digest for s in self.blobs.scan()}
        repaired: list[str] = []
        quarantined: list[str] = []
        with self.catalog.writing() as tx:
            stale = tx.blob_row_digests() - present
            tx.delete_blob_rows(stale)
            for snapshot_id in tx.incomplete_suspects():
                text = tx.manifest_text(snapshot_id) or '{"files": []}'
                digests = {f["digest"] for f in json.loads(text)["files"]}
                gone = tx.missing_blob_rows(digests)
                if gone:
                    reason = f"{len(gone)} of its {len(digests)} blob(s) are not on the server"
                    tx.quarantine_snapshot(snapshot_id, reason=reason)
                    quarantined.append(snapshot_id)
                elif digests - tx.referenced_digests(snapshot_id):
                    tx.add_references(snapshot_id, digests, at=utc_now())
                    tx.add_event(kind="snapshot.completed", subject=snapshot_id, detail=None)
                    repaired.append(snapshot_id)
        return CheckReport(len(stale), tuple(repaired), tuple(quarantined))

    # -- workloads, agents, status ------------------------------------------------------
    def list_workloads(self) -> list[WorkloadInfo]:
        return self.catalog.list_workloads()

    def put_workload(self, *, name: str, toml: str, digest: str) -> WorkloadInfo:
        with self.catalog.writing() as tx:
            self.budgets.admit_workload(tx, name=name)
            return tx.put_workload(name=name, toml=toml, digest=digest)

    def workload_toml(self, name: str) -> str:
        toml = self.catalog.workload_toml(name)
        if toml is None:
            raise WorkloadNotFound(f"no workload {name!r} is registered")
        return toml

    def delete_workload(self, name: str) -> None:
        with self.catalog.writing() as tx:
            if not tx.delete_workload(name):
                raise WorkloadNotFound(f"no workload {name!r} is registered")

    def register_agent(self, **registration: Any) -> tuple[AgentInfo, bool]:
        """(agent, created); see ``Transaction.register_agent`` for the keywords."""
        self.prune()
        with self.catalog.writing() as tx:
            self.budgets.admit_agent(
                tx,
                agent_id=agent_id_for(registration["name"]),
                fields={k: registration[k] for k in ("fingerprint", "gpus", "devices")},
                now=datetime.now(UTC),
            )
            agent_id, created = tx.register_agent(**registration)
        return self.agent(agent_id), created

    def agent(self, agent_id: str) -> AgentInfo:
        found = self.catalog.agent(agent_id)
        if found is None:
            raise AgentNotFound(f"no agent {agent_id!r} is registered (register it first)")
        return found

    def list_agents(self) -> list[AgentInfo]:
        return self.catalog.list_agents()

    def heartbeat(self, agent_id: str) -> AgentInfo:
        with self.catalog.writing() as tx:
            tx.agent_seen(agent_id)
        return self.agent(agent_id)

    def report_event(self, agent_id: str, **report: Any) -> EventOut:
        """Record an agent's report; see ``Transaction.add_agent_event`` for the keywords."""
        self.prune()
        size = event_bytes(
            workload=report["workload"],
            detail=report["detail"],
            traceback_tail=report["traceback_tail"],
        )
        with self.catalog.writing() as tx:
            if not tx.exists("agents", "id", agent_id):
                raise AgentNotFound(f"no agent {agent_id!r} is registered (register it first)")
            self.budgets.admit_agent_event(tx, size_bytes=size)
            event = tx.add_agent_event(agent_id, size_bytes=size, **report)
        if event is None:
            raise AgentNotFound(f"no agent {agent_id!r} is registered (register it first)")
        return event

    def fleet_status(
        self,
        *,
        workload: str | None = None,
        fingerprint_digest: str | None = None,
        devices: list[str] | None = None,
    ) -> list[StatusRow]:
        return fleet_status(
            self.catalog.status_facts(),
            workload=workload,
            fingerprint_digest=fingerprint_digest,
            devices=devices,
            serve_harvested=self.settings.serve_harvested,
        )

    def add_job_report(self, report: JobReport, *, token_id: str | None) -> tuple[int, str]:
        """Store one job report sent by ``token_id`` (None: auth is off), within that
        token's budget (RateLimited past it); (its id, when it was received)."""
        self.prune()
        with self.catalog.writing() as tx:
            at = utc_now()
            counted = self.budgets.admit_report(tx, report, token_id=token_id, at=at)
            report_id = tx.add_job_report(
                report, token_id=token_id, size_bytes=report_bytes(report), at=at
            )
            counted(report_id)
        return report_id, at

    def prune(self, *, force: bool = False) -> dict[str, int]:
        """A retention pass over the client-written tables when one is due (``force``:
        now); {table: rows deleted}."""
        due = self.budgets.prune_due()  # first: a forced pass restarts the minute too
        if not (due or force):
            return {}
        with self.catalog.writing() as tx:
            return self.budgets.prune(tx)

    def fingerprint_of(self, fingerprint_digest: str) -> Fingerprint | None:
        """The full fingerprint a stored snapshot records for ``fingerprint_digest``."""
        return self.catalog.fingerprint_of(fingerprint_digest)

    def restores_by_day(self, *, days: int = 60) -> list[tuple[str, int]]:
        return self.catalog.restores_by_day(days=days)

    def has_workload(self, name: str) -> bool:
        return self.catalog.workload_toml(name) is not None

    def unknown_workload(self, name: str) -> str | None:
        """Why ``name`` names nothing here, with a did-you-mean; None when it is known."""
        named = bool(self.catalog.candidates(name, limit=1))
        registered = [w.name for w in self.catalog.list_workloads()]
        return unknown_workload(name, registered=registered, named=named)

    def counts(self) -> Counts:
        return self.catalog.counts()

    def catalog_bytes(self) -> int:
        """meta.sqlite's size less its free pages (what ``max_catalog_bytes`` bounds)."""
        return self.catalog.catalog_bytes()

    # -- GC (server/resources/gc.py) --------------------------------------------------------------
    def plan_gc(self, *, target_bytes: int | None = None) -> GcPlan:
        """What a GC would delete now (``Collector.plan``); touches nothing."""
        return self._gc.plan(target_bytes=target_bytes)

    def execute_gc(self, plan: GcPlan) -> GcPlan:
        """Carry out ``plan``, each decision re-checked under the write lock
        (``Collector.execute``); returns what was done."""
        done = self._gc.execute(plan)
        self.evictions += len(done.snapshots_evicted)
        return done


def _uncompressed_size(blobs: BlobBackend, digest: str) -> int:
    total = 0
    with blobs.open(digest) as fh:
        while chunk := fh.read(1 << 20):
            total += len(chunk)
    return total


def _read_chunks(fh: BinaryIO, chunk_bytes: int = 4 << 20) -> Iterator[bytes]:
    with fh:
        while chunk := fh.read(chunk_bytes):
            yield chunk
