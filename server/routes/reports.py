"""``POST /v1/reports``: what training jobs saw, from both ends (docs/api.md).

``cachekeeper prejob`` reports a restore, or a cold start and its reason; ``cachekeeper
postjob`` reports what the job compiled on top of the restored snapshot. The catalog keeps
every report (``job_reports``) and adds them up per (workload, fingerprint digest) for
``GET /v1/status`` (``Catalog.job_stats``); this route also counts them for ``/metrics``.

Read scope, and a token of the caller's own where auth is on (``auth.identified``:
``anonymous_read`` does not admit a report): the nodes that run the hooks hold read
tokens, and every report is stored with the ``token_id`` that sent it and counted in that
token's budget for the window (``server/budgets.py``: past it, 429 ``rate_limited``).
A report names a workload the
server may not know (a misspelt name is a cold start worth seeing), so the metrics label a
workload that is not registered as ``-``, and a cold start's reason code that is not one of
the error table's as ``other``, to keep their label sets bounded (anyone with a read token
could otherwise make a Prometheus series per report); the answer's ``warning`` says when
the workload is not registered (with a did-you-mean) and no snapshot names it either.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from cachekeeper.errors import ERRORS, InsufficientStorage, RateLimited
from cachekeeper.server.auth import identified
from cachekeeper.server.deps import MetricsDep, ServicesDep
from cachekeeper.server.responses import error_responses
from cachekeeper.wire import JobReport, JobReportAnswer

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["reports"])

Reporter = Annotated[str | None, Depends(identified("read"))]


@router.post(
    "/reports",
    status_code=201,
    response_model=JobReportAnswer,
    responses=error_responses(RateLimited, InsufficientStorage),
)
def post_report(
    body: JobReport, services: ServicesDep, metrics: MetricsDep, reporter: Reporter
) -> JobReportAnswer:
    """Store one job report (prejob: restored or cold; postjob: compiled or clean),
    attributed to the token that sent it and within that token's budget."""
    report_id, at = services.reports.add(body, token_id=reporter)
    known = services.workloads.has(body.workload)
    workload = body.workload if known else "-"
    metrics.inc(
        "cachekeeper_job_reports_total", phase=body.phase, outcome=body.outcome, workload=workload
    )
    if body.phase == "prejob" and body.outcome == "cold":
        reason = body.reason_code or "unknown"
        if reason not in ERRORS and reason != "unknown":
            reason = "other"  # a code no cachekeeper raises: not a label of its own
        metrics.inc("cachekeeper_cold_starts_total", workload=workload, reason=reason)
    if body.phase == "postjob":
        for kind in ("fxgraph", "aotautograd", "triton", "other"):
            count = getattr(body, f"new_{kind}")
            if count:
                metrics.inc(
                    "cachekeeper_job_new_entries_total", count, workload=workload, kind=kind
                )
        if body.new_bytes:
            metrics.inc("cachekeeper_job_new_bytes_total", body.new_bytes, workload=workload)
    warning = None if known else services.resolver.unknown_workload(body.workload)
    return JobReportAnswer(id=report_id, at=at, warning=warning)
