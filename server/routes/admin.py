"""Health, metrics and GC: ``/healthz``, ``/metrics``, ``POST /v1/gc``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from cachekeeper.errors import CatalogCorrupt
from cachekeeper.server.auth import AdminScope, require
from cachekeeper.server.deps import ServicesDep, metrics_of
from cachekeeper.server.metrics import CONTENT_TYPE
from cachekeeper.server.responses import error_responses
from cachekeeper.wire import GcAnswer, GcRequest, Health

__all__ = ["router"]

router = APIRouter(tags=["admin"])


@router.get("/healthz", response_model=Health, responses=error_responses(CatalogCorrupt))
def healthz(request: Request, services: ServicesDep) -> Health:
    """Health: 200 while the catalog answers (the first and last row of every table are
    read: a few microseconds each, whatever its size), 503 ``catalog_corrupt`` with the
    reason once it cannot. Never touches the blob store."""
    problem = services.catalog.probe()
    if problem is not None:
        raise CatalogCorrupt(problem)
    return Health(status="ok", version=request.app.version)


async def _metrics_scope(request: Request) -> None:
    """/metrics needs the read scope (its labels name workloads) unless ``metrics_public``."""
    if not request.app.state.settings.metrics_public:
        await _read_scope(request)


_read_scope = require("read")


@router.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(_metrics_scope)])
def metrics(request: Request, services: ServicesDep) -> PlainTextResponse:
    """Prometheus text exposition (read scope, unless the server runs with metrics_public)."""
    counts = services.snapshots.counts()
    gauges = {
        "cachekeeper_store_bytes": float(counts.stored_bytes),
        "cachekeeper_store_blobs": float(counts.blobs),
        "cachekeeper_store_snapshots": float(counts.snapshots),
    }
    if (tier := request.app.state.tier) is not None:
        keys, stored = tier.totals()
        gauges["cachekeeper_remote_cache_keys"] = float(keys)
        gauges["cachekeeper_remote_cache_stored_bytes"] = float(stored)
        gauges["cachekeeper_remote_cache_connections"] = float(len(request.app.state.resp.clients))
    registry = metrics_of(request)
    evicted = services.gc.evictions - registry.value("cachekeeper_evictions_total")
    if evicted > 0:
        registry.inc("cachekeeper_evictions_total", evicted)
    packed = services.snapshots.packs - registry.value("cachekeeper_archive_packs_total")
    if packed > 0:
        registry.inc("cachekeeper_archive_packs_total", packed)
    budgets = services.budgets
    for name, by_reason in (
        ("cachekeeper_catalog_refusals_total", budgets.refused()),
        ("cachekeeper_catalog_pruned_total", budgets.pruned()),
    ):
        for (table, reason), count in by_reason.items():
            added = count - registry.value(name, table=table, reason=reason)
            if added > 0:
                registry.inc(name, added, table=table, reason=reason)
    gauges["cachekeeper_catalog_bytes"] = float(services.catalog.catalog_bytes())
    return PlainTextResponse(registry.render(gauges), media_type=CONTENT_TYPE)


@router.post("/v1/gc", response_model=GcAnswer)
def gc(services: ServicesDep, _: AdminScope, body: GcRequest | None = None) -> GcAnswer:
    """Evict LRU unpinned snapshots down to the cap, then delete unreferenced blobs."""
    dry_run = body.dry_run if body is not None else False
    plan = services.gc.plan()
    if not dry_run:
        plan = services.gc.execute(plan)
    return GcAnswer(
        snapshots_evicted=plan.snapshots_evicted,
        blobs_deleted=len(plan.blobs) + len(plan.orphan_files),
        bytes_freed=plan.bytes_freed,
        dry_run=dry_run,
        blobs_in_grace=len(plan.in_grace),
        bytes_in_grace=plan.in_grace_bytes,
        grace_ends_at=plan.grace_ends_at,
        grace_s=services.settings.gc_grace_s,
    )
