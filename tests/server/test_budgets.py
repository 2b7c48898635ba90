"""server/budgets.py (the rules and their queries): the weights, the totals the triggers
keep, the retention pass, and the settings, on real SQLite files (milliseconds each; the
attacks themselves are in tests/hardening/test_table_budgets.py)."""

from __future__ import annotations

import hashlib
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cachekeeper.errors import ConfigInvalid
from cachekeeper.server.auth import token_id
from cachekeeper.server.budgets import Budgets, drop_oldest, event_bytes, report_bytes, usage
from cachekeeper.server.catalog import Catalog
from cachekeeper.server.catalog.schema import EVENT_BYTES_SQL, REPORT_BYTES_SQL
from cachekeeper.server.resources.agents import add_agent_event, register_agent
from cachekeeper.server.resources.reports import add_job_report
from cachekeeper.server.settings import Settings, load_settings
from cachekeeper.wire import JobReport

FP = {"schema": 1, "torch": "2.13.0+cpu", "python": "3.11", "gpus": [], "env": {}}


def _report(i: int, **fields: object) -> JobReport:
    base: dict[str, object] = {
        "phase": "postjob",
        "outcome": "compiled",
        "workload": "wl",
        "fingerprint_digest": "a" * 64,
        "node": f"nœud-{i}",  # not ASCII: weights count bytes
        "devices": ["cuda:0", "cuda:1"],
        "reason": "ré" * i,
        "job": f"slurm:{i}",
        "started_at": "2026-01-01T00:00:00+00:00",
    }
    base.update(fields)
    return JobReport(**base)  # type: ignore[arg-type]


def _at(days_ago: float) -> str:
    return (datetime.now(UTC) - timedelta(days=days_ago)).isoformat(timespec="microseconds")


def test_token_id_is_a_short_hash_never_the_token() -> None:
    assert token_id("s3cret") == "tok-" + hashlib.sha256(b"s3cret").hexdigest()[:12]
    assert "s3cret" not in token_id("s3cret") and len(token_id("x")) == 16


def test_weights_in_python_and_in_sql_agree(tmp_path: Path) -> None:
    """New rows are weighed in Python, rows of an older catalog by SQL: the same sum."""
    catalog = Catalog.create(tmp_path / "meta.sqlite")
    with catalog.writing() as tx:
        for i in range(3):
            report = _report(i)
            add_job_report(tx, report, token_id=None, size_bytes=report_bytes(report), at=_at(0))
        agent_id, _ = register_agent(
            tx,
            name="b",
            fingerprint=FP,
            fingerprint_digest="e" * 64,
            devices=[],
            gpus=[],
            version="",
        )
        detail, tail = "failed: ß", ["Traceback", "  line ∂"]
        add_agent_event(
            tx,
            agent_id,
            workload="wl",
            fingerprint_digest="e" * 64,
            status="failed",
            detail=detail,
            traceback_tail=tail,
            snapshot_id=None,
            seconds=None,
            size_bytes=event_bytes(workload="wl", detail=detail, traceback_tail=tail),
        )
    conn = sqlite3.connect(tmp_path / "meta.sqlite")
    assert (
        conn.execute(f"SELECT size_bytes = {REPORT_BYTES_SQL} FROM job_reports").fetchall()
        == [(1,)] * 3
    )
    events = conn.execute(f"SELECT size_bytes = {EVENT_BYTES_SQL} FROM agent_events").fetchall()
    assert events == [(1,)]


def test_the_triggers_keep_the_totals_through_any_delete(tmp_path: Path) -> None:
    catalog = Catalog.create(tmp_path / "meta.sqlite")
    with catalog.writing() as tx:
        for i in range(50):
            report = _report(i)
            add_job_report(tx, report, token_id="tok-a", size_bytes=report_bytes(report), at=_at(0))
        drop_oldest(tx, "job_reports", rows=7)
        tx.db.execute("DELETE FROM job_reports WHERE id % 5 = 0")  # by hand, as an operator
        rows, stored = usage(tx, "job_reports")
        real = tx.db.execute("SELECT COUNT(*), SUM(size_bytes) FROM job_reports").fetchone()
    assert (rows, stored) == tuple(real) and rows < 50


def test_a_restart_counts_a_drifted_total_again(tmp_path: Path) -> None:
    """A catalog rebuilt by sqlite3 .recover keeps totals of rows it lost."""
    path = tmp_path / "meta.sqlite"
    catalog = Catalog.create(path)
    with catalog.writing() as tx:
        for i in range(10):
            report = _report(i)
            add_job_report(tx, report, token_id=None, size_bytes=report_bytes(report), at=_at(0))
    conn = sqlite3.connect(path)
    conn.execute("UPDATE table_usage SET rows = 99, bytes = 1 WHERE name = 'job_reports'")
    conn.commit()
    conn.close()
    again = Catalog.create(path)
    with again.writing() as tx:
        assert usage(tx, "job_reports") == tuple(
            tx.db.execute("SELECT COUNT(*), SUM(size_bytes) FROM job_reports").fetchone()
        )


def test_retention_drops_only_what_is_old_and_keeps_each_pairs_newest_event(
    tmp_path: Path,
) -> None:
    settings = Settings(
        data_dir=tmp_path, reports_retention_s="30d", agent_events_retention_s="30d"
    )
    catalog = Catalog.create(tmp_path / "meta.sqlite")
    budgets = Budgets(settings)
    with catalog.writing() as tx:
        for i, age in enumerate((40, 35, 1, 0)):
            report = _report(i)
            add_job_report(tx, report, token_id=None, size_bytes=report_bytes(report), at=_at(age))
        for (name, seen), digest in zip((("old", 100), ("new", 0)), ("1", "2"), strict=True):
            register_agent(
                tx,
                name=name,
                fingerprint=FP,
                fingerprint_digest=digest * 64,
                devices=[],
                gpus=[],
                version="",
            )
            tx.db.execute("UPDATE agents SET last_seen_at = ? WHERE name = ?", [_at(seen), name])
        for workload, age in (("w1", 60), ("w1", 50), ("w1", 2), ("w2", 90)):
            tx.db.execute(
                "INSERT INTO agent_events (at, agent_id, workload, fingerprint_digest, status,"
                " size_bytes) VALUES (?, 'x', ?, ?, 'failed', 10)",
                [_at(age), workload, "e" * 64],
            )
        done = budgets.prune(tx)
        left = tx.db.execute("SELECT workload, COUNT(*) FROM agent_events GROUP BY 1").fetchall()
        jobs = tx.db.execute("SELECT job FROM job_reports ORDER BY id").fetchall()
        agents = tx.db.execute("SELECT name FROM agents").fetchall()
    assert done == {"job_reports": 2, "agent_events": 2, "agents": 1, "events": 0}
    assert jobs == [("slurm:2",), ("slurm:3",)]
    assert dict(left) == {"w1": 1, "w2": 1}  # w2's only event is its newest: the status needs it
    assert agents == [("new",)]
    assert budgets.pruned() == {
        ("job_reports", "retention"): 2,
        ("agent_events", "retention"): 2,
        ("agents", "retention"): 1,
    }


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("CACHEKEEPER_REPORT_JOBS_PER_TOKEN", "0", "0 is not a positive count"),
        ("CACHEKEEPER_REPORTS_RETENTION_S", "soon", "'soon' is not a duration"),
        ("CACHEKEEPER_MAX_CATALOG_BYTES", "4parsecs", "is not a size"),
        ("CACHEKEEPER_CATALOG_CHECK", "deep", "quick"),
    ],
)
def test_budget_settings_are_checked_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, said: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigInvalid, match=variable) as caught:
        load_settings(data_dir=tmp_path)
    assert said in str(caught.value)


def test_units_are_read_for_budget_settings() -> None:
    settings = Settings(reports_retention_s="2d", reports_max_bytes="64MiB", reports_window_s="30m")
    assert settings.reports_retention_s == 172800.0
    assert settings.reports_max_bytes == 64 << 20 and settings.reports_window_s == 1800.0


def test_probe_answers_none_for_a_whole_catalog(tmp_path: Path) -> None:
    catalog = Catalog.create(tmp_path / "meta.sqlite")
    with catalog.writing() as tx:
        report = _report(1)
        add_job_report(tx, report, token_id=None, size_bytes=report_bytes(report), at=_at(0))
    assert catalog.probe() is None and catalog.broken is None


def test_a_tokens_window_survives_a_restart(tmp_path: Path) -> None:
    """The window is kept in memory, and read back from the reports after a restart: a
    restart never hands a token a fresh budget."""
    from tests.helpers.in_process import in_process

    settings = Settings(data_dir=tmp_path / "data", tokens={"r": "read"}, report_jobs_per_token=3)
    auth = {"Authorization": "Bearer r"}

    def report(job: str) -> dict[str, object]:
        return {
            "phase": "prejob",
            "outcome": "cold",
            "workload": "wl",
            "fingerprint_digest": "a" * 64,
            "node": "n",
            "job": job,
        }

    with in_process(settings) as server:
        codes = [
            server.client.post("/v1/reports", json=report(j), headers=auth).status_code
            for j in ("j1", "j2", "j3", "j1")
        ]
    with in_process(settings) as server:
        again = server.client.post("/v1/reports", json=report("j2"), headers=auth)
        fourth = server.client.post("/v1/reports", json=report("j4"), headers=auth)
    assert codes == [201, 201, 201, 201]  # j1 twice is one job
    assert again.status_code == 201  # a job it already reported is not new
    assert fourth.status_code == 429 and fourth.json()["budget"] == "report_jobs_per_token"
