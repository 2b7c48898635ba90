"""Job reports to the server (``POST /v1/reports``), stdlib only, best-effort.

The hooks (``prejob``, ``postjob``) report what they saw; a report must never slow or fail
the job, so it is one plain ``http.client`` request (importing httpx alone costs ~130 ms
of the hook's start-up budget) under the caller's time bound, and any trouble is a False
return, never an exception. ``post_json`` is also the hook's quick resolve.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from cachekeeper.errors import CachekeeperError
from cachekeeper.wire import JobReport, JobReportAnswer, from_dict, to_dict, utc_now

from .calls import endpoint, tls_context

__all__ = ["post_json", "send_report", "report_answer", "node_name", "utc_now"]


def node_name() -> str:
    """This node's name for reports: ``$SLURMD_NODENAME``, ``$NODE_NAME`` (Kubernetes'
    downward API, by convention), else the host name."""
    for var in ("SLURMD_NODENAME", "NODE_NAME"):
        if value := os.environ.get(var):
            return value[:256]
    return socket.gethostname()[:256]


def post_json(
    server: str | None, path: str, body: dict[str, Any], *, token: str | None, timeout_s: float
) -> tuple[int, bytes] | None:
    """POST ``body`` as JSON to route ``path`` of ``server`` (``calls.endpoint``): (status,
    body), or None on any trouble."""
    if not server or timeout_s <= 0:
        return None
    import http.client  # only with a server set: the hook's start-up budget
    from urllib.parse import urlsplit

    try:
        url = urlsplit(endpoint(server, path))
        if url.scheme == "http":
            conn: http.client.HTTPConnection = http.client.HTTPConnection(
                url.hostname or "", url.port, timeout=timeout_s
            )
        elif url.scheme == "https":
            conn = http.client.HTTPSConnection(
                url.hostname or "", url.port, timeout=timeout_s, context=tls_context()
            )
        else:
            return None
    except (ValueError, CachekeeperError):  # a bad URL, or a CA bundle that cannot be read
        return None
    headers = {"Content-Type": "application/json", "User-Agent": "cachekeeper-client"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request("POST", url.path, json.dumps(body).encode(), headers)
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def send_report(
    server: str | None, report: JobReport, *, token: str | None, timeout_s: float
) -> bool:
    """Send one job report; True when the server stored it."""
    return report_answer(server, report, token=token, timeout_s=timeout_s) is not None


def report_answer(
    server: str | None, report: JobReport, *, token: str | None, timeout_s: float
) -> JobReportAnswer | None:
    """Send one job report; the server's answer when it stored it (its ``warning`` says when
    the report names a workload the server does not know), else None."""
    answer = post_json(server, "/v1/reports", to_dict(report), token=token, timeout_s=timeout_s)
    if answer is None or answer[0] != 201:
        return None
    try:
        return from_dict(JobReportAnswer, json.loads(answer[1]))
    except ValueError:  # stored, but the answer is not the promised shape (an old server)
        return JobReportAnswer(id=0, at="")
