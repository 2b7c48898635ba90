"""/metrics on prometheus_client against the hand-written module before it, in one run.

    python bench/metrics_overhead.py [--before d398f4e] [--requests 20000] [--rounds 7] [--json]

The hand-written ``server/metrics.py`` is read from git at ``--before`` (it imports only the
standard library) and loaded beside the current one. Two costs, each measured for both
modules in the same process, the order alternated every round:

- **Per request**: an ASGI request through ``MetricsMiddleware`` to an app that answers
  200 with a 2-byte body, called directly (no socket), against the same app without the
  middleware; for a route outside the histograms (``GET /v1/status``) and one timed into
  ``cachekeeper_resolve_seconds`` (``POST /v1/resolve``; the hand-written module counts it
  and times nothing). The overhead is the request's time less the bare app's.
- **Render**: ``Metrics.render`` of a populated registry: 150 request series (25 routes,
  2 methods, 3 statuses), 50 workloads' job reports, cold starts and new entries (about
  1,100 series in all), and, for the new module, its histograms filled too.

Printed: the median per case, and new/old ratios. Only ratios in one run mean anything on
a shared host.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cachekeeper.server import metrics as new_module  # noqa: E402

ROUTES = [f"/v1/route{i}" for i in range(23)] + ["/v1/status", "/v1/resolve"]
WORKLOADS = [f"workload-{i}" for i in range(50)]


def old_module(rev: str) -> ModuleType:
    """The hand-written server/metrics.py at ``rev``, loaded as its own module."""
    text = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:server/metrics.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "prometheus_client" not in text, f"{rev}'s server/metrics.py is not the hand-written one"
    path = Path(tempfile.mkdtemp()) / "metrics_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("metrics_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Route:
    def __init__(self, path: str) -> None:
        self.path = path


async def _bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    scope["route"] = _Route(scope["path"])  # what Starlette's router sets
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def _requests(app: Any, *, method: str, path: str, count: int) -> float:
    """Seconds per request of ``count`` requests through ``app``."""
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    started = time.perf_counter()
    for _ in range(count):
        scope = {"type": "http", "method": method, "path": path}
        await app(scope, receive, send)
        sent.clear()
    return (time.perf_counter() - started) / count


def _populate(metrics: Any, *, histograms: bool) -> None:
    for route in ROUTES:
        for method in ("GET", "POST"):
            for status in ("200", "404", "500"):
                metrics.inc(
                    "cachekeeper_http_requests_total", route=route, method=method, status=status
                )
    for workload in WORKLOADS:
        for phase, outcome in (("prejob", "restored"), ("prejob", "cold"), ("postjob", "clean")):
            metrics.inc(
                "cachekeeper_job_reports_total", phase=phase, outcome=outcome, workload=workload
            )
        for reason in ("no_matching_snapshot", "server_unreachable", "timeout", "other"):
            metrics.inc("cachekeeper_cold_starts_total", workload=workload, reason=reason)
        for kind in ("fxgraph", "aotautograd", "triton", "other"):
            metrics.inc("cachekeeper_job_new_entries_total", 3, workload=workload, kind=kind)
        metrics.inc("cachekeeper_job_new_bytes_total", 1000, workload=workload)
    if histograms:
        for status in ("200", "404"):
            metrics.observe("cachekeeper_resolve_seconds", 0.004, status=status)
            metrics.observe("cachekeeper_publish_seconds", 0.05, status=status)
            for read in ("manifest", "archive", "archive_part", "blob"):
                metrics.observe("cachekeeper_restore_read_seconds", 0.3, read=read, status=status)
        for result in ("hit", "miss", "slow", "failed", "busy"):
            metrics.observe("cachekeeper_remote_cache_get_seconds", 0.0004, result=result)
        for result in ("stored", "store_failed", "busy"):
            metrics.observe("cachekeeper_remote_cache_put_seconds", 0.003, result=result)


GAUGES = {
    "cachekeeper_store_bytes": 1e9,
    "cachekeeper_store_blobs": 1e4,
    "cachekeeper_store_snapshots": 30.0,
}


def _render_s(metrics: Any, *, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        metrics.render(dict(GAUGES))
    return (time.perf_counter() - started) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--before", default="d398f4e", help="the git revision of the hand-written module"
    )
    parser.add_argument("--requests", type=int, default=20000, help="requests per case and round")
    parser.add_argument("--renders", type=int, default=50, help="renders per case and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    before = old_module(args.before)
    modules = {"old": before, "new": new_module}
    per_request: dict[str, list[float]] = {}
    render: dict[str, list[float]] = {}
    populated = {"old": before.Metrics(), "new": new_module.Metrics()}
    _populate(populated["old"], histograms=False)
    _populate(populated["new"], histograms=True)
    counters_only = new_module.Metrics()
    _populate(counters_only, histograms=False)

    async def request_round(order: list[str]) -> None:
        for case, (method, path) in {
            "untimed": ("GET", "/v1/status"),
            "timed": ("POST", "/v1/resolve"),
        }.items():
            bare = await _requests(_bare_app, method=method, path=path, count=args.requests)
            per_request.setdefault(f"bare_{case}", []).append(bare)
            for name in order:
                app = modules[name].MetricsMiddleware(_bare_app, metrics=modules[name].Metrics())
                took = await _requests(app, method=method, path=path, count=args.requests)
                per_request.setdefault(f"{name}_{case}", []).append(took)
                per_request.setdefault(f"{name}_{case}_overhead", []).append(took - bare)

    for round_ in range(args.rounds):
        order = ["old", "new"] if round_ % 2 == 0 else ["new", "old"]
        asyncio.run(request_round(order))
        for name in order:
            render.setdefault(name, []).append(_render_s(populated[name], count=args.renders))
        render.setdefault("new_counters_only", []).append(
            _render_s(counters_only, count=args.renders)
        )

    medians = {f"request_{k}_us": statistics.median(v) * 1e6 for k, v in per_request.items()}
    medians.update({f"render_{k}_ms": statistics.median(v) * 1e3 for k, v in render.items()})
    series = len(populated["new"].render().splitlines())
    ratios = {
        "request_overhead_untimed_new_over_old": medians["request_new_untimed_overhead_us"]
        / medians["request_old_untimed_overhead_us"],
        "request_overhead_timed_new_over_old": medians["request_new_timed_overhead_us"]
        / medians["request_old_timed_overhead_us"],
        "render_new_over_old": medians["render_new_ms"] / medians["render_old_ms"],
        "render_new_counters_only_over_old": medians["render_new_counters_only_ms"]
        / medians["render_old_ms"],
    }
    if args.json:
        print(
            json.dumps(
                {"medians": medians, "ratios": ratios, "lines": series, "rounds": args.rounds}
            )
        )
        return
    print(
        f"{args.rounds} rounds, {args.requests} requests and {args.renders} renders per case and round; new exposition {series} lines"
    )
    for key, value in medians.items():
        print(f"  {key:40s} {value:10.2f}")
    for key, value in ratios.items():
        print(f"  {key:40s} {value:10.2f}")


if __name__ == "__main__":
    main()
