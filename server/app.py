"""The composition root: ``create_app(settings)`` builds the FastAPI app and its store.

Routers, one per resource: ``routes_admin`` (/healthz, /metrics, /v1/gc),
``routes_resolve``, ``routes_blobs``, ``routes_snapshots``, ``routes_workloads``,
``routes_agents`` (/v1/agents, /v1/status), ``routes_reports`` (/v1/reports),
``routes_ui`` (the status page: /, /ui). To add one: write the module with an
``APIRouter`` named ``router`` using the dependencies in ``deps`` and ``auth``, add its
tables to ``catalog._SCHEMA_STEPS``, and add the module name to ``ROUTER_MODULES`` below.

Every request body is bounded in size and idle time, and JSON bodies are screened (depth,
non-finite numbers) before a route sees them: ``limits.RequestLimits``.

Every error answers ``{"error": CODE, "detail": TEXT, ...extra}``: ``CachekeeperError``
with its own code and status, FastAPI's request validation as 422 ``invalid_request``,
Starlette's HTTP errors (404, 405, ...) with a code derived from the status.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachekeeper import config
from cachekeeper.errors import CachekeeperError

from .limits import RequestLimits
from .metrics import Metrics, MetricsMiddleware
from .settings import Settings
from .storage import Storage

__all__ = ["create_app", "ROUTER_MODULES"]

ROUTER_MODULES: tuple[str, ...] = (
    "routes_admin",
    "routes_resolve",
    "routes_blobs",
    "routes_snapshots",
    "routes_workloads",
    "routes_agents",
    "routes_reports",
    "routes_ui",
)

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
        _log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"error": "server_error", "detail": f"internal error: {type(exc).__name__}"},
            status_code=500,
        )

    app.add_exception_handler(CachekeeperError, known)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def create_app(settings: Settings, *, storage: Storage | None = None) -> FastAPI:
    """A fresh app serving ``settings.data_dir`` (or the given ``storage``)."""
    app = FastAPI(
        title="cachekeeper",
        version=config.package_version(),
        summary="Store and serve torch.compile (Inductor) cache snapshots.",
    )
    app.state.settings = settings
    app.state.storage = storage if storage is not None else Storage.open(settings)
    app.state.metrics = Metrics()
    _install_error_handlers(app)
    for name in ROUTER_MODULES:
        module: Any = importlib.import_module(f"{__package__}.{name}")
        app.include_router(module.router)
    app.add_middleware(RequestLimits, settings=settings)  # inside metrics: refusals count
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app
