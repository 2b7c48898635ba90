"""The error answers a route declares in its OpenAPI entry (``responses=``).

Each route lists the ``cachekeeper.errors`` classes it can answer with; the schema then
shows, per status, the ``ErrorBody`` shape and the codes (in ``x-error-codes``), and
tests/server/test_api_doc.py checks docs/api.md against exactly that. The codes every route
can answer (401 ``unauthorized`` and 403 ``forbidden`` on a route with a scope, 422
``invalid_request`` for a parameter or body that does not validate, 413
``payload_too_large`` and 408 ``request_timeout`` from ``limits.RequestLimits``, 500
``server_error``, 503 ``catalog_corrupt`` from the catalog) are not listed per route;
docs/api.md states them once.
"""

from __future__ import annotations

from typing import Any

from cachekeeper.errors import CachekeeperError
from cachekeeper.wire import ErrorBody

__all__ = ["error_responses"]

ErrorSpec = type[CachekeeperError] | tuple[int, type[CachekeeperError]]


def error_responses(*errors: ErrorSpec) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for these errors: each at its class's status, or at ``(status, cls)``."""
    codes: dict[int, list[str]] = {}
    for spec in errors:
        status, cls = spec if isinstance(spec, tuple) else (spec.http_status, spec)
        codes.setdefault(status, []).append(cls.code)
    return {
        status: {"model": ErrorBody, "description": ", ".join(names), "x-error-codes": names}
        for status, names in sorted(codes.items())
    }
