"""Job reports to the server (``POST /v1/reports``), stdlib only, best-effort.

The hooks (``prejob``, ``postjob``) report what they saw; a report must never slow or fail
the job, so it is one plain ``http.client`` request (importing httpx alone costs ~130 ms
of the hook's start-up budget) under the caller's time bound, and any trouble is a False
return, never an exception. ``post_json`` is also the hook's quick resolve.

A job is counted once (``job_id``): every report carries the job it belongs to, so the
server counts the prejob of each rank, or a postjob run twice, as one job of that node:

- ``slurm:<SLURM_JOB_ID>`` under SLURM (a task prolog runs once per task),
- ``torchelastic:<TORCHELASTIC_RUN_ID>`` in a rank torchrun started,
- else the id the job's first prejob left in the cache dir, ``.cachekeeper/job.json``: a
  prejob reuses one written less than ``JOB_WINDOW_S`` ago (the ranks of one job start
  together) and otherwise writes a new one; a postjob reuses it whatever its age (the job
  it follows may have run for days). Without one (a read-only dir) a report is a job.

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
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachekeeper.errors import CacheDirUnusable, CachekeeperError
from cachekeeper.marker import state_dir
from cachekeeper.wire import JobReport, JobReportAnswer, from_dict, to_dict, utc_now

from .calls import endpoint, tls_context

__all__ = [
    "MAX_ANSWER_BYTES",
    "post_json",
    "send_report",
    "report_answer",
    "node_name",
    "job_id",
    "utc_now",
]

MAX_ANSWER_BYTES = 16 << 20  # a resolve answer is kilobytes; a report's answer bytes
JOB_WINDOW_S = 120.0  # prejobs on one dir this close together are the ranks of one job
JOB_FILE = "job.json"


def node_name() -> str:
    """This node's name for reports: ``$SLURMD_NODENAME``, ``$NODE_NAME`` (Kubernetes'
    downward API, by convention), else the host name."""
    for var in ("SLURMD_NODENAME", "NODE_NAME"):
        if value := os.environ.get(var):
            return value[:256]
    return socket.gethostname()[:256]


def job_id(cache_dir: Path, *, environ: Mapping[str, str], start: bool) -> str | None:
    """The job a report belongs to (see the module docstring); ``start``: a prejob's (it
    may write a new id), else a postjob's. None when there is none to find or write."""
    if environ.get("SLURM_JOB_ID"):
        return f"slurm:{environ['SLURM_JOB_ID']}"[:128]
    if environ.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none"):
        return f"torchelastic:{environ['TORCHELASTIC_RUN_ID']}"[:128]
    job, at = _read_job(cache_dir)
    if not start or (job is not None and time.time() - at < JOB_WINDOW_S):
        return job
    if not Path(cache_dir).is_dir():
        return None  # never create the cache dir for this
    import fcntl  # the ranks of one job arriving together agree on one id

    try:  # through the state folder's descriptors: a link planted there is never followed
        with state_dir(Path(cache_dir), create=True) as state:
            lock = state.open_file("job.lock", os.O_WRONLY | os.O_CREAT)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                job, at = _parse_job(state.read_file(JOB_FILE))  # written while we waited?
                if job is not None and time.time() - at < JOB_WINDOW_S:
                    return job
                job = f"local:{secrets.token_hex(8)}"
                state.write_file(JOB_FILE, json.dumps({"job": job, "at": time.time()}).encode())
                return job
            finally:
                os.close(lock)
    except (OSError, CacheDirUnusable):  # a read-only dir, a planted link: its own job
        return None


def _read_job(cache_dir: Path) -> tuple[str | None, float]:
    try:
        with state_dir(Path(cache_dir), create=False) as state:
            return _parse_job(state.read_file(JOB_FILE))
    except (OSError, CacheDirUnusable):
        return None, 0.0


def _parse_job(raw: bytes | None) -> tuple[str | None, float]:
    try:
        found = json.loads(raw or b"")
        return str(found["job"]), float(found["at"])
    except (ValueError, KeyError, TypeError):
        return None, 0.0


def post_json(
    server: str | None, path: str, body: dict[str, Any], *, token: str | None, timeout_s: float
) -> tuple[int, bytes] | None:
    """POST ``body`` as JSON to route ``path`` of ``server`` (``calls.endpoint``): (status,
    body), or None on any trouble, including not being done within ``timeout_s`` in all (see
    the module docstring)."""
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
        conn.connect()
        if conn.sock is not None:
            socks.append(conn.sock)
        if cut.is_set():  # connected after the caller gave up: nobody waits for the answer
            return None
        conn.request("POST", url.path, json.dumps(body).encode(), headers)
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
