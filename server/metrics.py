"""``/metrics``: prometheus_client's counters, gauges and histograms, one registry per app.

``Metrics`` is the facade the routes, the middleware and the tier's listener call: ``inc``
(a counter), ``observe`` (a histogram), ``value`` (a counter's or gauge's value now, a
histogram's count: for the status page and tests) and ``render`` (the exposition, with the
store's gauges read when ``/metrics`` is scraped). Each app has its own
``CollectorRegistry``, never prometheus_client's global one: tests build many apps in one
process, and two servers in one process must not share their counts.

Every metric is declared here: ``_HELP`` gives its type and help text, ``_LABELS`` its label
names (none when absent), ``_BUCKETS`` a histogram's buckets. A new one is an entry in
``_HELP`` (and ``_LABELS`` when labelled), then ``inc``/``observe`` calls; an undeclared
name is a KeyError and labels other than the declared ones a ValueError, at the first call
(a test that reaches the call finds it), never a series nobody documented.

What the hand-written exposition before it showed stays as it was, since dashboards read
it: every name, label and value; the text format (Prometheus' 0.0.4, whatever the scraper
asks for); a counter never counted, shown as one unlabelled 0; no ``_created`` series
(prometheus_client adds one beside each counter and histogram series: ``_Exposed``, the
registry's one collector, leaves them out). Values are written the way prometheus_client
writes floats (``2.0`` where it wrote ``2``), which every Prometheus parser reads alike.

``MetricsMiddleware`` (plain ASGI, so it sees streamed bodies without buffering them)
counts requests by route template and status and the bytes in and out, and times the
routes of ``TIMED_ROUTES`` to their last byte sent. Routes count what only they know
(resolves by outcome, blob downloads, archive requests); the per-key tier's listener and
writer time GETs and PUTs (``server/resp/listener.py``, ``server/resources/tier.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

__all__ = ["CONTENT_TYPE", "Metrics", "MetricsMiddleware", "TIMED_ROUTES"]

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what /metrics answered before prometheus_client

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
    # Histograms (issue 33): how long what nodes and builders wait on takes, server side.
    "cachekeeper_resolve_seconds": (
        "histogram",
        "POST /v1/resolve: seconds from the request to its answer's last byte, by status.",
    ),
    "cachekeeper_publish_seconds": (
        "histogram",
        "POST /v1/snapshots (publish a manifest whose blobs are uploaded): seconds from the"
        " request to its answer's last byte, by status.",
    ),
    "cachekeeper_restore_read_seconds": (
        "histogram",
        "The reads a node's restore makes of this server: seconds from the request to the"
        " last byte sent, by read (manifest: GET /v1/snapshots/{id}; archive: GET"
        " /v1/snapshots/{id}/archive; archive_part: POST of the same, some blobs; blob: GET"
        " /v1/blobs/{digest}) and status. Reads a node makes of the object store directly"
        " are not here.",
    ),
    "cachekeeper_remote_cache_get_seconds": (
        "histogram",
        "Per-key tier GETs: seconds from the command to its reply (a hit's value read from"
        " memory or the store), by result as in cachekeeper_remote_cache_gets_total; sending"
        " the reply is not counted.",
    ),
    "cachekeeper_remote_cache_put_seconds": (
        "histogram",
        "Per-key tier PUTs: seconds to store one value (its blob, then its key row), by"
        " result (stored, store_failed, or why it was dropped); the writer stores a SET after"
        " it was answered OK, so a node never waits on this.",
    ),
}

# Label names of the labelled metrics, as their callers pass them.
_LABELS: dict[str, tuple[str, ...]] = {
    "cachekeeper_http_requests_total": ("route", "method", "status"),
    "cachekeeper_resolves_total": ("outcome",),
    "cachekeeper_blob_uploads_total": ("result",),
    "cachekeeper_job_reports_total": ("phase", "outcome", "workload"),
    "cachekeeper_cold_starts_total": ("workload", "reason"),
    "cachekeeper_job_new_entries_total": ("workload", "kind"),
    "cachekeeper_job_new_bytes_total": ("workload",),
    "cachekeeper_remote_cache_gets_total": ("result",),
    "cachekeeper_remote_cache_puts_total": ("result",),
    "cachekeeper_remote_cache_bytes_total": ("direction",),
    "cachekeeper_remote_cache_connections_closed_total": ("reason",),
    "cachekeeper_catalog_refusals_total": ("table", "reason"),
    "cachekeeper_catalog_pruned_total": ("table", "reason"),
    "cachekeeper_resolve_seconds": ("status",),
    "cachekeeper_publish_seconds": ("status",),
    "cachekeeper_restore_read_seconds": ("read", "status"),
    "cachekeeper_remote_cache_get_seconds": ("result",),
    "cachekeeper_remote_cache_put_seconds": ("result",),
}

# HTTP: a resolve answers in milliseconds; an archive of hundreds of MB streams for seconds
# to minutes. The tier: a hot GET is answered from memory in microseconds.
_HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0, 300.0)  # fmt: skip
_TIER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0)  # fmt: skip
_BUCKETS: dict[str, tuple[float, ...]] = {
    "cachekeeper_resolve_seconds": _HTTP_BUCKETS,
    "cachekeeper_publish_seconds": _HTTP_BUCKETS,
    "cachekeeper_restore_read_seconds": _HTTP_BUCKETS,
    "cachekeeper_remote_cache_get_seconds": _TIER_BUCKETS,
    "cachekeeper_remote_cache_put_seconds": _TIER_BUCKETS,
}

# Routes timed to their last byte sent: (method, route template) -> (histogram, its labels
# besides status).
TIMED_ROUTES: dict[tuple[str, str], tuple[str, dict[str, str]]] = {
    ("POST", "/v1/resolve"): ("cachekeeper_resolve_seconds", {}),
    ("POST", "/v1/snapshots"): ("cachekeeper_publish_seconds", {}),
    ("GET", "/v1/snapshots/{snapshot_id}"): ("cachekeeper_restore_read_seconds", {"read": "manifest"}),
    ("GET", "/v1/snapshots/{snapshot_id}/archive"): ("cachekeeper_restore_read_seconds", {"read": "archive"}),
    ("POST", "/v1/snapshots/{snapshot_id}/archive"): ("cachekeeper_restore_read_seconds", {"read": "archive_part"}),
    ("GET", "/v1/blobs/{digest}"): ("cachekeeper_restore_read_seconds", {"read": "blob"}),
}  # fmt: skip

_KINDS: dict[str, Callable[..., MetricWrapperBase]] = {
    "counter": Counter,
    "gauge": Gauge,
    "histogram": Histogram,
}


def _declare(name: str) -> MetricWrapperBase:
    """The prometheus_client metric ``name`` is declared as, registered nowhere."""
    kind, text = _HELP[name]
    options: dict[str, Any] = {"labelnames": _LABELS.get(name, ()), "registry": None}
    if kind == "histogram":
        options["buckets"] = _BUCKETS[name]
    return _KINDS[kind](name, text, **options)


class _Exposed:
    """The registry's one collector: the declared metrics, sorted by name, as the
    hand-written exposition showed them (no ``_created`` series; a counter never counted
    is one unlabelled 0)."""

    def __init__(self, metrics: Mapping[str, MetricWrapperBase]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        for name in sorted(self._metrics):
            for family in self._metrics[name].collect():
                created = family.name + "_created"
                family.samples = [s for s in family.samples if s.name != created]
                if family.type == "counter" and not family.samples:
                    family.samples = [Sample(family.name + "_total", {}, 0.0)]
                yield family


class Metrics:
    """The app's metrics (declared in ``_HELP``) in its own ``CollectorRegistry``."""

    def __init__(self) -> None:
        self._metrics = {name: _declare(name) for name in _HELP}
        self._children: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Exposed(self._metrics))

    def _metric(self, name: str, labels: Mapping[str, str]) -> Any:
        """The metric ``name``'s child with ``labels`` (kept: prometheus_client's own
        ``labels()`` validates them at every call, a third of a request's metrics cost)."""
        key = (name, tuple(sorted(labels.items())))
        child = self._children.get(key)
        if child is None:
            try:
                metric = self._metrics[name]
            except KeyError:
                raise KeyError(
                    f"metric {name!r} is not declared in server/metrics.py's _HELP"
                ) from None
            child = metric.labels(**labels) if labels else metric
            self._children[key] = child
        return child

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (not negative) to the counter ``name`` with ``labels``."""
        self._metric(name, labels).inc(amount)

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        """Record ``seconds`` in the histogram ``name`` with ``labels``."""
        self._metric(name, labels).observe(seconds)

    def value(self, name: str, **labels: str) -> float:
        """A counter's or gauge's value with exactly ``labels`` (0 when never counted); a
        histogram's count of observations."""
        metric = self._metrics.get(name)
        if metric is None:
            return 0.0
        wanted = {name, f"{name}_count"}
        for family in metric.collect():
            for sample in family.samples:
                if sample.name in wanted and sample.labels == labels:
                    return float(sample.value)
        return 0.0

    def render(self, gauges: dict[str, float] | None = None) -> str:
        """The exposition text; ``gauges`` (name -> value) are set first (unlabelled)."""
        for name, value in (gauges or {}).items():
            self._metric(name, {}).set(value)
        return generate_latest(self.registry).decode("utf-8")


class MetricsMiddleware:
    """Count requests (by route template and status) and body bytes in and out; time the
    routes of ``TIMED_ROUTES`` to their last byte sent."""

    def __init__(self, app: Callable[..., Any], *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
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
            code = str(status["code"])
            labels = {"route": template, "method": scope["method"], "status": code}
            self.metrics.inc("cachekeeper_http_requests_total", **labels)
            self.metrics.inc("cachekeeper_http_request_bytes_total", sizes["in"])
            self.metrics.inc("cachekeeper_http_response_bytes_total", sizes["out"])
            timed = TIMED_ROUTES.get((scope["method"], template))
            if timed is not None:
                histogram, fixed = timed
                seconds = time.perf_counter() - started
                self.metrics.observe(histogram, seconds, **fixed, status=code)
