"""Prometheus text exposition (format 0.0.4), written by hand: counters behind one lock.

``MetricsMiddleware`` (plain ASGI, so it sees streamed bodies without buffering them)
counts requests by route template and status and the bytes in and out. Routes count what
only they know (resolves by outcome, blob downloads, archive requests); gauges of the
store are read from the catalog when ``/metrics`` is scraped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Metrics", "MetricsMiddleware"]

_HELP = {
    "cachekeeper_http_requests_total": ("counter", "HTTP requests by route and status."),
    "cachekeeper_http_request_bytes_total": ("counter", "Request body bytes received."),
    "cachekeeper_http_response_bytes_total": ("counter", "Response body bytes sent."),
    "cachekeeper_resolves_total": ("counter", "Resolve requests by outcome."),
    "cachekeeper_blob_uploads_total": ("counter", "Blob uploads by result."),
    "cachekeeper_blob_downloads_total": ("counter", "GET /v1/blobs/{digest} answered."),
    "cachekeeper_archive_requests_total": ("counter", "Snapshot archive streams started."),
    "cachekeeper_archive_blobs_total": ("counter", "Blobs sent inside archive streams."),
    "cachekeeper_snapshots_published_total": ("counter", "Snapshots newly published."),
    "cachekeeper_evictions_total": ("counter", "Snapshots evicted by GC."),
    "cachekeeper_archive_packs_total": (
        "counter",
        "Archive objects packed at publish (object store); a retried publish packs none.",
    ),
    "cachekeeper_job_reports_total": (
        "counter",
        "Job reports (POST /v1/reports) by phase, outcome and workload.",
    ),
    "cachekeeper_cold_starts_total": ("counter", "Prejob cold starts by workload and reason."),
    "cachekeeper_job_new_entries_total": (
        "counter",
        "Cache entries jobs compiled on top of the restore, by workload and kind.",
    ),
    "cachekeeper_job_new_bytes_total": (
        "counter",
        "Bytes of the entries jobs compiled on top of the restore, by workload.",
    ),
    "cachekeeper_remote_cache_gets_total": (
        "counter",
        "Per-key tier GETs by result: hit, miss, slow (answered nil past the bound), failed,"
        " busy (answered nil: replies not yet taken by clients were over their budget),"
        " other_environment (written from another fingerprint).",
    ),
    "cachekeeper_remote_cache_puts_total": (
        "counter",
        "Per-key tier SETs by result: stored, or answered OK and dropped: read_only_token,"
        " signatures_required, key_too_long, too_large, busy, store_failed.",
    ),
    "cachekeeper_remote_cache_bytes_total": (
        "counter",
        "Per-key tier value bytes by direction: in (stored), out (served), direct (sent to the"
        " object store by a 307, not through the server).",
    ),
    "cachekeeper_remote_cache_evictions_total": (
        "counter",
        "Per-key tier keys evicted (least recently used) to fit its budget.",
    ),
    "cachekeeper_remote_cache_protocol_errors_total": (
        "counter",
        "Per-key tier connections closed for sending something that is not RESP.",
    ),
    "cachekeeper_remote_cache_auth_failures_total": (
        "counter",
        "Per-key tier AUTHs with a token the server does not know.",
    ),
    "cachekeeper_remote_cache_connections_closed_total": (
        "counter",
        "Per-key tier connections the server closed, by reason: auth_timeout, idle_timeout,"
        " frame_timeout, send_timeout, evicted (for a new one at the cap), max_clients"
        " (refused at the cap), http (an HTTP request), protocol_error, auth_failures,"
        " auth_throttled, error.",
    ),
    "cachekeeper_remote_cache_connections": (
        "gauge",
        "Per-key tier connections open now.",
    ),
    "cachekeeper_remote_cache_keys": ("gauge", "Keys in the per-key tier."),
    "cachekeeper_remote_cache_stored_bytes": (
        "gauge",
        "Stored bytes of the per-key tier: its values, and its keys' rows (keys, writers).",
    ),
    "cachekeeper_catalog_refusals_total": (
        "counter",
        "Rows a client sent that a table's budget refused, by table and reason"
        " (server/budgets.py): reports_per_token, report_jobs_per_token, max_rows,"
        " catalog_bytes, ...",
    ),
    "cachekeeper_catalog_pruned_total": (
        "counter",
        "Rows deleted to keep a client-written table within its bound or retention, by"
        " table and reason (max_rows, max_bytes, retention).",
    ),
    "cachekeeper_catalog_bytes": ("gauge", "meta.sqlite's size less its free pages."),
    "cachekeeper_store_bytes": ("gauge", "Stored (compressed) blob bytes."),
    "cachekeeper_store_blobs": ("gauge", "Blobs in the store."),
    "cachekeeper_store_snapshots": ("gauge", "Snapshots in the store."),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    """Thread-safe counters keyed by name and sorted label pairs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0.0)

    def render(self, gauges: dict[str, float] | None = None) -> str:
        """The exposition text; ``gauges`` (name -> value) are appended unlabelled."""
        with self._lock:
            items = sorted(self._values.items())
        by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], float]]] = {}
        for (name, labels), value in items:
            by_name.setdefault(name, []).append((labels, value))
        for name, value in (gauges or {}).items():
            by_name.setdefault(name, []).append(((), value))
        for name in _HELP:  # always expose the documented counters, even at zero
            by_name.setdefault(name, [((), 0.0)])
        lines: list[str] = []
        for name in sorted(by_name):
            kind, text = _HELP.get(name, ("untyped", name))
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in by_name[name]:
                label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                shown = int(value) if float(value).is_integer() else value
                lines.append(f"{name}{{{label_text}}} {shown}" if label_text else f"{name} {shown}")
        return "\n".join(lines) + "\n"


class MetricsMiddleware:
    """Count requests (by route template and status) and body bytes in and out."""

    def __init__(self, app: Callable[..., Any], *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}
        sizes = {"in": 0, "out": 0}

        async def counting_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                sizes["in"] += len(message.get("body", b""))
            return message

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            elif message["type"] == "http.response.body":
                sizes["out"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            labels = {"route": template, "method": scope["method"], "status": str(status["code"])}
            self.metrics.inc("cachekeeper_http_requests_total", **labels)
            self.metrics.inc("cachekeeper_http_request_bytes_total", sizes["in"])
            self.metrics.inc("cachekeeper_http_response_bytes_total", sizes["out"])
