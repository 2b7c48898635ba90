"""Job reports to the server (``POST /v1/reports``), stdlib only, best-effort.

The hooks (``prejob``, ``postjob``) report what they saw; a report must never slow or fail
the job, so it is one plain ``http.client`` request (importing httpx alone costs ~130 ms
of the hook's start-up budget) under the caller's time bound, and any trouble is a False
return, never an exception. ``post_json`` is also the hook's quick resolve.

The time bound is a wall-clock bound on the whole request, not a socket timeout (which
bounds each read alone, so a server trickling a byte a second would never trip it): the
request runs in a daemon thread that the caller stops waiting for at the bound, and the
socket is shut down then, so the thread ends too. Name resolution, connecting, sending and
reading all count. The answer is read up to ``MAX_ANSWER_BYTES``; a longer one is trouble.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from typing import Any

from cachekeeper.wire import JobReport, to_dict, utc_now

__all__ = ["MAX_ANSWER_BYTES", "post_json", "send_report", "node_name", "utc_now"]

MAX_ANSWER_BYTES = 16 << 20  # a resolve answer is kilobytes; a report's answer bytes


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
    """POST ``body`` as JSON to ``server`` + ``path``: (status, body), or None on any trouble,
    including not being done within ``timeout_s`` in all (see the module docstring)."""
    if not server or timeout_s <= 0:
        return None
    found: list[tuple[int, bytes] | None] = [None]
    cut = threading.Event()
    socks: list[socket.socket] = []

    def run() -> None:
        found[0] = _post(server, path, body, token=token, timeout_s=timeout_s, socks=socks, cut=cut)

    worker = threading.Thread(target=run, name="cachekeeper-post", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        cut.set()
        for sock in socks:  # a blocked read returns at once: the thread ends soon after
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return None
    return found[0]


def _post(
    server: str,
    path: str,
    body: dict[str, Any],
    *,
    token: str | None,
    timeout_s: float,
    socks: list[socket.socket],
    cut: threading.Event,
) -> tuple[int, bytes] | None:
    import http.client  # only with a server set: the hook's start-up budget
    from urllib.parse import urlsplit

    try:
        url = urlsplit(server)
        if url.scheme == "http":
            conn: http.client.HTTPConnection = http.client.HTTPConnection(
                url.hostname or "", url.port, timeout=timeout_s
            )
        elif url.scheme == "https":
            conn = http.client.HTTPSConnection(url.hostname or "", url.port, timeout=timeout_s)
        else:
            return None
    except ValueError:
        return None
    headers = {"Content-Type": "application/json", "User-Agent": "cachekeeper-client"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.connect()
        if conn.sock is not None:
            socks.append(conn.sock)
        if cut.is_set():  # connected after the caller gave up: nobody waits for the answer
            return None
        conn.request("POST", url.path.rstrip("/") + path, json.dumps(body).encode(), headers)
        response = conn.getresponse()
        data = response.read(MAX_ANSWER_BYTES + 1)
        if len(data) > MAX_ANSWER_BYTES:
            return None
        return response.status, data
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def send_report(
    server: str | None, report: JobReport, *, token: str | None, timeout_s: float
) -> bool:
    """Send one job report; True when the server stored it."""
    answer = post_json(server, "/v1/reports", to_dict(report), token=token, timeout_s=timeout_s)
    return answer is not None and answer[0] == 201
