"""Job reports to the server (``POST /v1/reports``), stdlib only, best-effort.

The hooks (``prejob``, ``postjob``) report what they saw; a report must never slow or fail
the job, so it is the transport's one plain ``http.client`` request
(``client.transport.post_json``: importing httpx alone costs ~130 ms of the hook's start-up
budget) under the caller's time bound, and any trouble is a False return, never an
exception.

A job is counted once (``job_id``): every report carries the job it belongs to, so the
server counts the prejob of each rank, or a postjob run twice, as one job of that node:

- ``slurm:<SLURM_JOB_ID>`` under SLURM (a task prolog runs once per task),
- ``torchelastic:<TORCHELASTIC_RUN_ID>`` in a rank torchrun started,
- else the id the job's first prejob left in the cache dir, ``.cachekeeper/job.json``: a
  prejob reuses one written less than ``JOB_WINDOW_S`` ago (the ranks of one job start
  together) and otherwise writes a new one; a postjob reuses it whatever its age (the job
  it follows may have run for days). Without one (a read-only dir) a report is a job.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from cachekeeper.errors import CacheDirUnusable
from cachekeeper.restore.marker import state_dir
from cachekeeper.wire import JobReport, JobReportAnswer, from_dict, to_dict, utc_now

from .transport import post_json

__all__ = [
    "send_report",
    "report_answer",
    "node_name",
    "job_id",
    "utc_now",
]

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
