"""The composition root: ``create_app(settings)`` builds the FastAPI app and its services.

Blob backends are opened through ``cachekeeper/backends/registry.py`` ``open_backend`` (the
one table of URL schemes, which the settings' check reads too): the local directory by
default, or the object store ``--blob-store`` names (``s3://``).
``open_services`` opens the snapshots' backend and the catalog (``<data>/meta.sqlite``,
refused when SQLite finds it corrupt: ``settings.catalog_check``), builds one service per
resource over them (``server/services.py``), then runs the retention of the tables clients
write (``server/budgets.py``) and the snapshots' start-up check. Routers, one per resource in ``server/routes/``, are
included directly below: ``admin`` (/healthz, /metrics, /v1/gc), ``resolve``, ``blobs``,
``snapshots``, ``workloads``, ``agents`` (/v1/agents, /v1/status), ``reports``
(/v1/reports), ``tier`` (/v1/tier: the per-key tier over HTTP), ``ui`` (the status
page: /, /ui). To add one: write the module in
``server/routes/`` with an ``APIRouter`` named ``router`` using the dependencies in
``deps`` and ``auth``, calling its resource's service (``server/resources/``: the service and
its queries in one module; a new resource also gets its field in ``server/services.py``),
and include it in ``create_app``.

The per-key tier (``settings.resp_port`` set): ``open_tier`` opens its blob backend (beside
the snapshots' own, never the same folder or prefix, so GC of one never touches the
other) and ``app.state.resp`` is its listener (``server/resp/listener.py``), which ``serve``
starts and stops with uvicorn; ``app.state.tier`` is None without it.

Every request body is bounded in size and idle time, and JSON bodies are screened (depth,
non-finite numbers) before a route sees them: ``limits.RequestLimits``.

Every error answers ``{"error": CODE, "detail": TEXT, ...extra}``: ``CachekeeperError``
with its own code and status, FastAPI's request validation as 422 ``invalid_request``,
Starlette's HTTP errors (404, 405, ...) with a code derived from the status.
"""

from __future__ import annotations

import logging
import sqlite3

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachekeeper import config
from cachekeeper.backends.registry import open_backend
from cachekeeper.errors import CachekeeperError

from .auth import Need, route_scopes
from .catalog import Catalog, is_corruption
from .limits import RequestLimits
from .metrics import Metrics, MetricsMiddleware
from .resources.tier import Tier
from .resp.listener import RespServer
from .routes import admin, agents, blobs, reports, resolve, snapshots, tier, ui, workloads
from .services import Services
from .settings import Settings

__all__ = ["create_app", "open_services", "open_tier"]

_log = logging.getLogger("cachekeeper.server")

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def _install_error_handlers(app: FastAPI) -> None:
    async def known(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, CachekeeperError)
        return JSONResponse(exc.to_dict(), status_code=exc.http_status)

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return JSONResponse(
            {"error": "invalid_request", "detail": _validation_detail(exc)}, status_code=422
        )

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return JSONResponse(
            {"error": code, "detail": str(exc.detail)},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        if is_corruption(exc):  # a query the catalog layer did not wrap met a damaged page
            assert isinstance(exc, sqlite3.DatabaseError)
            broken = request.app.state.services.catalog.met(exc)
            return JSONResponse(broken.to_dict(), status_code=broken.http_status)
        _log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"error": "server_error", "detail": f"internal error: {type(exc).__name__}"},
            status_code=500,
        )

    app.add_exception_handler(CachekeeperError, known)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def open_services(settings: Settings) -> Services:
    """SQLite at ``<data>/meta.sqlite``; blobs at ``<data>/blobs`` (the default) or in the
    S3-compatible object store ``settings.blob_store`` names (``s3://BUCKET/PREFIX``)."""
    data = settings.data_dir
    data.mkdir(parents=True, exist_ok=True)
    catalog = Catalog.create(data / "meta.sqlite", check=settings.catalog_check)
    backend = open_backend(settings.blob_store, local_root=data / "blobs")
    services = Services.build(settings=settings, catalog=catalog, backend=backend)
    # the retention of the client-written tables (budgets.py)
    services.budgets.retain(catalog, force=True)
    report = services.snapshots.check()
    if report.stale_blob_rows or report.completed or report.quarantined:
        _log.warning(
            "start-up check: dropped %d blob row(s) whose bytes were gone; completed %d"
            " half-published snapshot(s); quarantined %d whose blobs are gone: %s",
            report.stale_blob_rows,
            len(report.completed),
            len(report.quarantined),
            ", ".join(s[:12] for s in report.quarantined) or "-",
        )
    return services


def open_tier(settings: Settings, catalog: Catalog) -> Tier:
    """The per-key tier: keys in ``catalog``, values in ``<data>/tier-blobs`` or under
    ``tier/`` of the object store's prefix."""
    url = None if settings.blob_store is None else f"{settings.blob_store.rstrip('/')}/tier"
    backend = open_backend(url, local_root=settings.data_dir / "tier-blobs")
    return Tier(
        catalog=catalog,
        blobs=backend,
        max_value_bytes=settings.remote_cache_max_value_bytes,
        max_bytes=settings.remote_cache_max_bytes,
        memory_bytes=settings.remote_cache_memory_bytes,
        cross_environment=settings.remote_cache_cross_environment,
    )


def create_app(settings: Settings, *, services: Services | None = None) -> FastAPI:
    """A fresh app serving ``settings.data_dir`` (or the given ``services``)."""
    app = FastAPI(
        title="cachekeeper",
        version=config.package_version(),
        summary="Store and serve torch.compile (Inductor) cache snapshots.",
    )
    app.state.settings = settings
    app.state.services = services if services is not None else open_services(settings)
    app.state.metrics = Metrics()
    app.state.tier = (
        None if settings.resp_port is None else open_tier(settings, app.state.services.catalog)
    )
    app.state.resp = (
        None
        if app.state.tier is None
        else RespServer(store=app.state.tier, settings=settings, metrics=app.state.metrics)
    )
    _install_error_handlers(app)
    scoped: list[tuple[APIRoute, Need]] = []
    # tier first: a herd of nodes asks its GET, and a request is matched against the routes
    # in order (FastAPI tries each in turn)
    for module in (tier, admin, resolve, blobs, snapshots, workloads, agents, reports, ui):
        app.include_router(module.router)
        scoped += route_scopes(module.router.routes)
    # Inside metrics: refusals count.
    app.add_middleware(RequestLimits, settings=settings, route_scopes=scoped)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app
