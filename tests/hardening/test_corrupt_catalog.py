"""Issue 32, class 8: a corrupt catalog looked healthy. One bad page in the job reports'
b-tree: ``/healthz`` answered 200 while ``/v1/status`` answered 500. Each test damages a
real ``meta.sqlite`` (random bytes over one leaf page of ``job_reports``, found with
SQLite's ``dbstat``), proves the damage with its own connection first, then checks what
the server does: refuse to start in one line naming the file and the way back, or, for a
page that goes bad while it serves, answer 503 ``catalog_corrupt`` and fail ``/healthz``."""

from __future__ import annotations

import hashlib
import shutil
import socket
import sqlite3
import subprocess
from pathlib import Path

import httpx
import pytest

from cachekeeper.server.app import open_services
from cachekeeper.server.budgets import report_bytes
from cachekeeper.server.resources.reports import add_job_report
from cachekeeper.server.settings import Settings
from cachekeeper.wire import JobReport, utc_now
from tests.hardening.conftest import ServerProcess, child_env, cli
from tests.helpers.live_server import start_server
from tests.helpers.ports import free_port
from tests.helpers.sqlite_pages import checkpoint, leaf_pages, smash_page

REPORTS = 3000  # a few hundred leaf pages of job_reports


def _catalog_with_reports(data: Path) -> Path:
    """A server's data dir whose catalog holds REPORTS job reports; its meta.sqlite."""
    services = open_services(Settings(data_dir=data))
    devices = [f"cuda:{i}" for i in range(8)]
    with services.catalog.writing() as tx:
        for i in range(REPORTS):
            report = JobReport(
                phase="prejob",
                outcome="restored",
                workload="wl",
                fingerprint_digest="a" * 64,
                snapshot_id="b" * 64,
                node=f"node-{i % 50}",
                devices=devices,
                job=f"slurm:{i}",
            )
            add_job_report(
                tx,
                report,
                token_id="tok-000000000000",
                size_bytes=report_bytes(report),
                at=utc_now(),
            )
    services.catalog.db().conn.close()
    path = data / "meta.sqlite"
    checkpoint(path)
    return path


def _assert_damaged(path: Path) -> None:
    """The damage is real: reading every report through SQLite fails as malformed."""
    conn = sqlite3.connect(path)
    try:
        with pytest.raises(sqlite3.DatabaseError, match="malformed"):
            conn.execute("SELECT SUM(LENGTH(devices)) FROM job_reports").fetchall()
    finally:
        conn.close()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_corrupt_catalog_is_refused_at_start_in_one_line(tmp_path: Path, reliability) -> None:
    data = tmp_path / "data"
    path = _catalog_with_reports(data)
    pages = leaf_pages(path, "job_reports")
    assert len(pages) > 20
    smash_page(path, pages[len(pages) // 2])  # one bad page in the middle, as in the attack
    _assert_damaged(path)
    before = _sha(path)
    port = free_port()
    done = subprocess.run(
        cli("serve", "--data", str(data), "--port", str(port)),
        env=child_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr  # it served, /healthz 200, before
    assert len(lines) == 1, done.stderr
    (line,) = lines
    assert line.startswith(f"error: catalog {path} is corrupt (PRAGMA quick_check:"), line
    assert "backup" in line and ".recover" in line and "[catalog_corrupt]" in line
    assert "docs/operations.md, 'A corrupt catalog'" in line
    assert _sha(path) == before  # the refusal wrote nothing into the damaged file
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # nothing listens
    reliability.record(
        "catalog with random bytes over one leaf page of job_reports: serve refuses to start,"
        " one line naming the file, PRAGMA quick_check's finding and the way back (a backup,"
        " or the sqlite3 shell's .recover: docs/operations.md); the file is left as it was",
        tries=1,
        outcome="refused",
        area="corrupt catalog",
    )


def _rebuild(damaged: Path, rebuilt: Path) -> str:
    """docs/operations.md's commands, 'A corrupt catalog': ``.recover``, or, from a sqlite3
    shell built without it, ``.dump`` with its closing ROLLBACK made a COMMIT; which ran."""
    recover = subprocess.run(["sqlite3", str(damaged), ".recover"], capture_output=True)
    if recover.returncode == 0:
        subprocess.run(["sqlite3", str(rebuilt)], input=recover.stdout, check=True)
        return ".recover"
    dump = subprocess.run(["sqlite3", str(damaged), ".dump"], capture_output=True, check=True)
    fixed = dump.stdout.replace(b"\nROLLBACK; -- due to errors\n", b"\nCOMMIT;\n")
    subprocess.run(["sqlite3", str(rebuilt)], input=fixed, check=True)
    return ".dump"


@pytest.mark.skipif(shutil.which("sqlite3") is None, reason="the sqlite3 command-line shell")
def test_the_advice_brings_the_server_back(tmp_path: Path, reliability) -> None:
    """What the refusal points to works: the file rebuilt from what SQLite can still read
    and moved into place, the server starts (the bad page's rows are gone, and the
    reports' totals are counted again)."""
    data = tmp_path / "data"
    path = _catalog_with_reports(data)
    pages = leaf_pages(path, "job_reports")
    smash_page(path, pages[len(pages) // 2])
    _assert_damaged(path)
    rebuilt = data / "meta.rebuilt.sqlite"
    how = _rebuild(path, rebuilt)
    path.rename(data / "meta.sqlite.damaged")
    rebuilt.rename(path)
    server = ServerProcess(data_dir=data, home=tmp_path / "home")
    try:
        server.start()
        with httpx.Client(base_url=server.url) as c:
            status = c.get("/v1/status")
            health = c.get("/healthz")
    finally:
        server.kill()
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT COUNT(*) FROM job_reports").fetchone()[0]
        usage = conn.execute("SELECT rows FROM table_usage WHERE name = 'job_reports'").fetchone()
    finally:
        conn.close()
    assert status.status_code == 200 and health.status_code == 200
    assert 0 < rows < REPORTS and usage == (rows,)
    reliability.record(
        f"the refusal's advice followed (the file rebuilt with sqlite3 {how}, moved into"
        " place): the server starts and answers; the reports' totals are counted again",
        tries=1,
        outcome="recovered",
        area="corrupt catalog",
    )


def test_a_page_gone_bad_while_serving_answers_503_and_fails_healthz(
    tmp_path: Path, reliability
) -> None:
    """The attack's state: a server running on a catalog in which one reports page went
    bad. /v1/status met it (a 500 before) and now says 503 catalog_corrupt with the way
    back; /healthz (200 before) and every later request answer 503 too."""
    data = tmp_path / "data"
    path = _catalog_with_reports(data)
    with start_server(Settings(data_dir=data)) as live, httpx.Client(base_url=live.url) as c:
        pages = leaf_pages(path, "job_reports")
        smash_page(path, pages[len(pages) // 2])
        _assert_damaged(path)
        status = c.get("/v1/status")
        health = c.get("/healthz")
        workloads = c.get("/v1/workloads")
        page = c.get("/")
    assert status.status_code == 503, status.text
    said = status.json()
    assert said["error"] == "catalog_corrupt" and "malformed" in said["detail"]
    assert "meta.sqlite" in said["detail"] and "docs/operations.md" in said["detail"]
    assert str(data) not in said["detail"]  # the server's own paths stay in its log
    assert health.status_code == 503 and health.json()["error"] == "catalog_corrupt"
    assert workloads.status_code == 503 and page.status_code == 503
    reliability.record(
        "one leaf page of job_reports overwritten while the server runs: /v1/status answers"
        " 503 catalog_corrupt (was 500), and /healthz and every later request 503 (healthz"
        " was 200)",
        tries=1,
        outcome="refused",
        area="corrupt catalog",
    )


def test_healthz_finds_a_bad_last_page_by_itself(tmp_path: Path, reliability) -> None:
    """/healthz reads the first and last row of every table: a damaged last page of the
    reports fails it with no other request before. (No /healthz before the damage: SQLite
    keeps the pages a connection read until some connection writes, so a probe just
    before would answer from its copy.)"""
    data = tmp_path / "data"
    path = _catalog_with_reports(data)
    with start_server(Settings(data_dir=data)) as live, httpx.Client(base_url=live.url) as c:
        smash_page(path, leaf_pages(path, "job_reports")[-1])
        _assert_damaged(path)
        after = c.get("/healthz")
    assert after.status_code == 503, after.text  # 200 before
    assert after.json()["error"] == "catalog_corrupt"
    reliability.record(
        "the last leaf page of job_reports overwritten while the server runs: the next"
        " /healthz answers 503 catalog_corrupt with no other request before it",
        tries=1,
        outcome="refused",
        area="corrupt catalog",
    )
