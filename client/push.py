"""Push a cache dir to the server: snapshot locally, upload only the missing blobs, publish.

The local store already holds every blob as a zstd frame, so an upload sends that frame
as is (``Content-Encoding: zstd``) and the server decompresses and hashes it before
storing. Pushing the same dir twice asks the server what it lacks, uploads nothing and
publishes the identical manifest again (the server answers ``created: false``).

The publish waits longer than other requests (``publish_timeout_for``): a server whose
blobs are in an object store reads every blob back, hashes it and packs the snapshot's
archive before it answers. A publish that times out is retried (``CacheClient``); the
server lets the retry wait for the pack in progress, so nothing is packed twice.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachekeeper.errors import BlobMissing, Forbidden, Unauthorized, WorkloadNotFound
from cachekeeper.integrity import CHUNK_BYTES
from cachekeeper.snapshot.make import snapshot_dir
from cachekeeper.snapshot.manifest import Manifest
from cachekeeper.snapshot.provenance import load_prewarm_record, recorded_workloads
from cachekeeper.store import LocalStore
from cachekeeper.wire import to_dict

from .api import CacheClient, Deadline
from .direct import ObjectStore

if TYPE_CHECKING:
    from cachekeeper.environment.fingerprint import Fingerprint

__all__ = [
    "PUBLISH_BYTES_PER_S",
    "PUBLISH_S_PER_BLOB",
    "PushReport",
    "push",
    "publish_timeout_for",
    "upload_missing",
    "check_registered",
    "unverified_reason",
]

_MISSING_BATCH = 1000  # digests per blobs/missing request
PUBLISH_BYTES_PER_S = 2 << 20  # the publish rule's conservative check-and-pack rate
PUBLISH_S_PER_BLOB = 0.02  # and its time per blob (the server reads each one back)

# (wire bytes sent so far, wire bytes to send in all), called from the upload threads.
Progress = Callable[[int, int], None]
# (blob bytes the server checks, blobs, seconds the push waits), once before the publish.
PublishStart = Callable[[int, int, float], None]


def publish_timeout_for(*, blob_bytes: int, blob_count: int, floor_s: float = 30.0) -> float:
    """How long a push waits for its publish: ``floor_s`` (the client's request timeout)
    plus 1 s per 2 MiB and 20 ms per blob of the snapshot (all its distinct blobs).

    At publish, a server whose blobs are in an object store reads every blob back (one
    GET each), hashes it, packs the archive and uploads it before it answers, so its time
    grows with both. The rates are about half what a loaded 2-core host with a
    single-process S3 server (moto) measured before the pack read blobs in parallel
    (docs/benchmarks.md), so only a stuck server times out; a local-dir server answers a
    publish in well under the floor.
    """
    return floor_s + blob_bytes / PUBLISH_BYTES_PER_S + blob_count * PUBLISH_S_PER_BLOB


@dataclass(frozen=True)
class PushReport:
    """What a push did. Sizes are uncompressed unless named ``*_wire_bytes``."""

    snapshot_id: str
    workload: str
    created: bool  # False: the server already had this exact manifest
    file_count: int
    blob_count: int
    uploaded_blobs: int
    uploaded_bytes: int
    uploaded_wire_bytes: int
    deduplicated_blobs: int
    deduplicated_bytes: int
    verified: bool = False  # a prewarm of this workload verified the dir effective
    unverified_reason: str | None = None  # why not, in one sentence; None when verified
    offered: bool = True  # resolve hands it to nodes (False: a harvest the server keeps back)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


@dataclass(frozen=True)
class _Uploaded:
    blobs: int
    bytes: int
    wire_bytes: int


def upload_missing(
    manifest: Manifest,
    *,
    client: CacheClient,
    store: LocalStore,
    workers: int = 4,
    progress: Progress | None = None,
    deadline: Deadline | None = None,
    only: set[str] | None = None,
) -> _Uploaded:
    """Upload the blobs of ``manifest`` the server lacks (of ``only``, if given), in parallel.

    A server whose blobs are in an object store answers a presigned PUT per missing blob:
    those go straight to the store, uncompressed (the store names a blob by its sha256,
    sent as ``x-amz-checksum-sha256``); the server hashes them again at publish.
    """
    sizes = {f.digest: f.size_bytes for f in manifest.files}
    asked = sorted(set(sizes) if only is None else only)
    # In batches: an object-store server presigns a PUT per missing blob (~2 ms each).
    answers = [
        client.missing(asked[start : start + _MISSING_BATCH], deadline=deadline)
        for start in range(0, len(asked), _MISSING_BATCH)
    ] or [client.missing([], deadline=deadline)]
    todo = sorted(d for answer in answers for d in answer.missing)
    direct = {u.digest: u for answer in answers for u in answer.uploads}
    wire = {d: sizes[d] if d in direct else store.blobs.size(d) or 0 for d in todo}
    total_wire = sum(wire.values())
    sent = 0
    lock = threading.Lock()

    def upload(digest: str) -> None:
        nonlocal sent
        target = direct.get(digest)
        if target is None:
            client.put_blob_zstd(digest, lambda: store.blobs.open_raw(digest), deadline=deadline)
        else:
            objects.put(
                target.url,
                open_body=lambda: _chunks(store, digest),
                size_bytes=sizes[digest],
                headers=target.headers,
                deadline=deadline,
            )
        with lock:
            sent += wire[digest]
            if progress is not None:
                progress(sent, total_wire)

    if progress is not None:
        progress(0, total_wire)
    with ObjectStore(timeout_s=client.timeout_s) as objects:
        if todo:
            with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
                # list() re-raises the first upload error after the pool drains.
                list(pool.map(upload, todo))
    return _Uploaded(len(todo), sum(sizes[d] for d in todo), total_wire)


def _chunks(store: LocalStore, digest: str) -> Iterator[bytes]:
    """The blob's uncompressed bytes from the local store, a chunk at a time."""
    with store.blobs.open(digest) as fh:
        while chunk := fh.read(CHUNK_BYTES):
            yield chunk


def push(
    cache_dir: Path,
    *,
    client: CacheClient,
    workload: str,
    store: LocalStore | None = None,
    workers: int = 4,
    progress: Progress | None = None,
    fingerprint: Fingerprint | None = None,
    sign_key: str | os.PathLike[str] | None = None,
    require_registered: bool = False,
    only: Collection[str] | None = None,
    parent: str | None = None,
    publish_timeout_s: float | None = None,
    on_publish: PublishStart | None = None,
    allow_empty: bool = False,
) -> PushReport:
    """Snapshot ``cache_dir`` into the local store, upload what the server lacks, publish.

    A dir with no file a snapshot takes is ``EmptyCacheDir`` (saying what was scanned)
    before anything is saved or uploaded, unless ``allow_empty``.

    The publish waits ``publish_timeout_s`` (default: ``publish_timeout_for`` the
    snapshot); ``on_publish`` is told what the server checks, and for how long the push
    waits, just before.

    With ``only`` and ``parent``: a harvested delta of only those paths, parented on the
    snapshot ``parent`` (``cachekeeper postjob --push``; see ``snapshot_dir``), under the
    parent's fingerprint (``fingerprint`` is then not used).

    A snapshot's fingerprint is the one its caches were built with: a prewarm's record in
    ``cache_dir`` sets its CPU part (the workload's ``[process] omp_num_threads``) whatever
    ``fingerprint`` says (``snapshot_dir``).

    With ``sign_key``, the published manifest carries an Ed25519 signature by that key.
    With ``require_registered``, a workload the server has no registration of is refused
    (``WorkloadNotFound``) before anything is snapshotted or uploaded. The report says
    whether the snapshot is verified and, when not, why (``unverified_reason``).
    A token the server refuses raises ``Unauthorized`` / ``Forbidden`` saying that a push
    needs the ``write`` scope.
    """
    try:
        return _push(
            Path(cache_dir),
            client=client,
            workload=workload,
            store=store,
            workers=workers,
            progress=progress,
            fingerprint=fingerprint,
            sign_key=sign_key,
            require_registered=require_registered,
            only=only,
            parent=parent,
            publish_timeout_s=publish_timeout_s,
            on_publish=on_publish,
            allow_empty=allow_empty,
        )
    except (Unauthorized, Forbidden) as exc:
        if exc.extra.get("scope") == "write":
            raise
        # A read route refused first (blobs/missing, the workload check): the push as a
        # whole needs more than what that answer names.
        raise type(exc)(
            f"a push to {client.base_url} needs a token with the 'write' scope; {exc.detail}",
            extra=exc.extra,
        ) from exc


def unverified_reason(cache_dir: Path, workload: str) -> str | None:
    """Why a snapshot of ``cache_dir`` as ``workload`` would be unverified; None if it is not."""
    record = load_prewarm_record(cache_dir, workload)
    if record is not None:
        verify = (record.get("stats") or {}).get("verify") or {}
        if verify.get("effective"):
            return None
        return f"the prewarm of {workload!r} did not verify {cache_dir} effective"
    others = recorded_workloads(cache_dir)
    if others:
        names = ", ".join(repr(n) for n in others)
        return f"{cache_dir} was prewarmed and verified for {names}, not for {workload!r}"
    return f"no prewarm of {workload!r} verified {cache_dir} (cachekeeper prewarm records one)"


def check_registered(client: CacheClient, workload: str) -> None:
    """Raise ``WorkloadNotFound`` unless the server has ``workload`` registered."""
    try:
        client.get_workload(workload)
    except WorkloadNotFound as exc:
        raise WorkloadNotFound(
            f"no workload {workload!r} is registered on {client.base_url}: register it "
            f"first (cachekeeper workload register FILE), check the name, or pass "
            "--allow-unregistered to publish it anyway",
            extra=exc.extra,
        ) from exc


def _push(
    cache_dir: Path,
    *,
    client: CacheClient,
    workload: str,
    store: LocalStore | None,
    workers: int,
    progress: Progress | None,
    fingerprint: Fingerprint | None,
    sign_key: str | os.PathLike[str] | None,
    require_registered: bool,
    only: Collection[str] | None = None,
    parent: str | None = None,
    publish_timeout_s: float | None = None,
    on_publish: PublishStart | None = None,
    allow_empty: bool = False,
) -> PushReport:
    if require_registered:
        check_registered(client, workload)
    store = store if store is not None else LocalStore()
    if parent is not None:
        # A harvested delta was compiled on a node that resolved its parent, and resolve
        # offers it only with the parent, to nodes of the parent's fingerprint digest: it
        # carries the parent's fingerprint (the one its caches match), not the node's own,
        # which may differ in what matching allows (a newer driver, idle GPU indices).
        fingerprint = client.get_manifest(parent).fingerprint
    manifest = snapshot_dir(
        Path(cache_dir),
        store=store,
        workload=workload,
        fingerprint=fingerprint,
        sign_key=sign_key,
        only=only,
        parent=parent,
        allow_empty=allow_empty,
    )
    done = upload_missing(manifest, client=client, store=store, workers=workers, progress=progress)
    sizes = {f.digest: f.size_bytes for f in manifest.files}
    waits_s = publish_timeout_s
    if waits_s is None:
        blob_bytes, floor_s = sum(sizes.values()), client.timeout_s
        waits_s = publish_timeout_for(blob_bytes=blob_bytes, blob_count=len(sizes), floor_s=floor_s)
    if on_publish is not None:
        on_publish(sum(sizes.values()), len(sizes), waits_s)
    try:
        summary = client.publish(manifest, timeout_s=waits_s)
    except BlobMissing as exc:
        # A blob vanished server-side between the check and the publish (a gc): send it again.
        again = {d for d in exc.extra.get("missing", []) if d in manifest.digests}
        if not again:
            raise
        more = upload_missing(manifest, client=client, store=store, workers=workers, only=again)
        done = _Uploaded(
            done.blobs + more.blobs, done.bytes + more.bytes, done.wire_bytes + more.wire_bytes
        )
        summary = client.publish(manifest, timeout_s=waits_s)
    return PushReport(
        snapshot_id=manifest.id,
        workload=workload,
        created=summary.created,
        file_count=len(manifest.files),
        blob_count=len(sizes),
        uploaded_blobs=done.blobs,
        uploaded_bytes=done.bytes,
        uploaded_wire_bytes=done.wire_bytes,
        deduplicated_blobs=len(sizes) - done.blobs,
        deduplicated_bytes=sum(sizes.values()) - done.bytes,
        verified=manifest.verified,
        unverified_reason=None if manifest.verified else unverified_reason(cache_dir, workload),
        offered=summary.offered,
    )
