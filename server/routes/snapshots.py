"""``/v1/snapshots``: publish a manifest, list, fetch, stream as an archive, delete, pin."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from cachekeeper.errors import (
    BlobMissing,
    InsufficientStorage,
    InvalidManifest,
    PayloadTooLarge,
    SignatureInvalid,
    SnapshotNotFound,
    UnsafePath,
    UnsupportedFormat,
)
from cachekeeper.integrity import DIGEST_PATTERN
from cachekeeper.server.auth import AdminScope, ReadScope, WriteScope
from cachekeeper.server.deps import ServicesDep, metrics_of, read_body, services_of
from cachekeeper.server.responses import error_responses
from cachekeeper.server.services import Services
from cachekeeper.snapshot.manifest import Manifest
from cachekeeper.snapshot.signing import load_trusted_keys, verify_manifest
from cachekeeper.wire import ArchiveRequest, PublishAnswer, SnapshotList, Summary

__all__ = ["router"]

router = APIRouter(prefix="/v1/snapshots", tags=["snapshots"])

SnapshotId = Annotated[str, Path(pattern=DIGEST_PATTERN, description="the manifest's sha256")]


def _publish(services: Services, body: bytes) -> tuple[Summary, bool]:
    max_files = services.settings.max_files
    listed = body.count(b'"digest"')  # a scan, before parsing builds millions of objects
    if listed > max_files:
        raise PayloadTooLarge(
            f"manifest lists about {listed} files, over the server's limit of {max_files}"
        )
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidManifest(f"manifest is not valid JSON: {exc}") from exc
    if (
        isinstance(raw, dict)
        and isinstance(raw.get("files"), list)
        and len(raw["files"]) > max_files
    ):
        raise PayloadTooLarge(
            f"manifest lists {len(raw['files'])} files, over the server's limit of {max_files}"
        )
    manifest = Manifest.from_dict(raw, max_files=max_files)
    if services.settings.require_signatures:
        # Read per publish (two tiny files): a rotated key needs no restart.
        verify_manifest(manifest, load_trusted_keys(services.settings.trusted_keys))
    return services.snapshots.publish(manifest)


@router.post(
    "",
    status_code=201,
    response_model=PublishAnswer,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"type": "object", "description": "a manifest"}}
            },
        }
    },
    responses={
        200: {"model": PublishAnswer, "description": "an identical manifest was already published"},
        **error_responses(
            BlobMissing,
            InvalidManifest,
            UnsafePath,
            UnsupportedFormat,
            SignatureInvalid,  # only when the server requires signatures
            InsufficientStorage,  # the metadata disk is full: nothing was published
        ),
    },
)
async def publish_snapshot(request: Request, _: WriteScope) -> Response:
    """Publish a manifest whose blobs are all uploaded; idempotent for an identical one."""
    services = services_of(request)
    body = await read_body(request, limit=services.settings.max_manifest_bytes, what="manifest")
    summary, created = await run_in_threadpool(_publish, services, body)
    if created:
        metrics_of(request).inc("cachekeeper_snapshots_published_total")
    offered = summary.source != "harvest" or services.settings.serve_harvested
    return JSONResponse(
        {**asdict(summary), "created": created, "offered": offered},
        status_code=201 if created else 200,
    )


@router.get("", response_model=SnapshotList)
def list_snapshots(
    services: ServicesDep,
    _: ReadScope,
    workload: str | None = None,
    fingerprint_digest: str | None = None,
    verified: bool | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    """Snapshots, newest first, optionally filtered."""
    found = services.snapshots.summaries(
        workload=workload, fingerprint_digest=fingerprint_digest, verified=verified, limit=limit
    )
    return {"snapshots": [asdict(s) for s in found]}


@router.get(
    "/{snapshot_id}",
    response_class=Response,
    responses={200: {"content": {"application/json": {}}}, **error_responses(SnapshotNotFound)},
)
def get_snapshot(snapshot_id: SnapshotId, services: ServicesDep, _: ReadScope) -> Response:
    """The manifest JSON, signature included."""
    return Response(services.snapshots.manifest_text(snapshot_id), media_type="application/json")


def _archive(
    request: Request, services: Services, snapshot_id: str, wanted: list[str] | None
) -> Response:
    metrics = metrics_of(request)
    chunks = services.snapshots.archive(
        snapshot_id,
        digests=wanted,
        on_blob=lambda _d: metrics.inc("cachekeeper_archive_blobs_total"),
    )
    metrics.inc("cachekeeper_archive_requests_total")
    return StreamingResponse(
        chunks, media_type="application/zstd", headers={"X-Cachekeeper-Snapshot": snapshot_id}
    )


_ARCHIVE_DOC: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/zstd": {}}, "description": "zstd(tar)"},
    **error_responses(SnapshotNotFound),
}


@router.get("/{snapshot_id}/archive", response_class=Response, responses=_ARCHIVE_DOC)
def get_archive(
    snapshot_id: SnapshotId, request: Request, services: ServicesDep, _: ReadScope
) -> Response:
    """The whole snapshot as one ``zstd(tar(manifest.json, blobs/<sha256>...))`` stream."""
    return _archive(request, services, snapshot_id, None)


@router.post("/{snapshot_id}/archive", response_class=Response, responses=_ARCHIVE_DOC)
def post_archive(
    snapshot_id: SnapshotId,
    body: ArchiveRequest,
    request: Request,
    services: ServicesDep,
    _: ReadScope,
) -> Response:
    """The same stream holding only the named blobs (those not in the snapshot are ignored)."""
    return _archive(request, services, snapshot_id, body.digests)


@router.delete(
    "/{snapshot_id}",
    status_code=204,
    response_class=Response,
    responses=error_responses(SnapshotNotFound),
)
def delete_snapshot(snapshot_id: SnapshotId, services: ServicesDep, _: AdminScope) -> Response:
    """Remove a snapshot; blobs no other snapshot uses go at the next GC."""
    services.snapshots.delete(snapshot_id)
    return Response(status_code=204)


@router.post(
    "/{snapshot_id}/pin", response_model=Summary, responses=error_responses(SnapshotNotFound)
)
def pin_snapshot(snapshot_id: SnapshotId, services: ServicesDep, _: WriteScope) -> dict[str, Any]:
    """Keep a snapshot out of LRU eviction."""
    return asdict(services.snapshots.set_pinned(snapshot_id, pinned=True))


@router.delete(
    "/{snapshot_id}/pin", response_model=Summary, responses=error_responses(SnapshotNotFound)
)
def unpin_snapshot(snapshot_id: SnapshotId, services: ServicesDep, _: WriteScope) -> dict[str, Any]:
    """Let LRU eviction take a snapshot again."""
    return asdict(services.snapshots.set_pinned(snapshot_id, pinned=False))
