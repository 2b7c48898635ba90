"""The job reports resource (``/v1/reports``): what training jobs report of their
restores, cold starts and compiles; its service ``Reports`` and its queries (the
``job_reports`` table).

Each report is checked against its sender's budget (``token_id``) and the table's bounds in
the same transaction as its row (``server/budgets.py``). The fleet status adds the reports
up per (workload, fingerprint digest) with ``job_stats`` (``server/resources/fleet.py``).
"""

from __future__ import annotations

import json

from cachekeeper.server.budgets import Budgets, report_bytes
from cachekeeper.server.catalog import Catalog, Transaction
from cachekeeper.wire import JobReport, JobStats, utc_now

__all__ = ["Reports", "add_job_report", "job_stats", "restores_by_day"]

# One job on one node: its reports share ``job`` (a report without one is its own job).
_JOB_KEY = "CASE WHEN job IS NULL THEN 'report:' || id ELSE node || '|' || job END"


def _jobs(condition: str) -> str:
    """SQL counting the distinct jobs among the reports that meet ``condition``."""
    return f"COUNT(DISTINCT CASE WHEN {condition} THEN {_JOB_KEY} END)"


class Reports:
    """The job reports as the routes and the status page see them."""

    def __init__(self, *, catalog: Catalog, budgets: Budgets) -> None:
        self.catalog = catalog
        self.budgets = budgets

    def add(self, report: JobReport, *, token_id: str | None) -> tuple[int, str]:
        """Store one job report sent by ``token_id`` (None: auth is off), within that
        token's budget (RateLimited past it); (its id, when it was received)."""
        self.budgets.retain(self.catalog)
        with self.catalog.writing() as tx:
            at = utc_now()
            counted = self.budgets.admit_report(tx, report, token_id=token_id, at=at)
            report_id = add_job_report(
                tx, report, token_id=token_id, size_bytes=report_bytes(report), at=at
            )
            counted(report_id)
        return report_id, at

    def restores_by_day(self, *, days: int = 60) -> list[tuple[str, int]]:
        return restores_by_day(self.catalog, days=days)


# -- queries: the job reports ----------------------------------------------------------


def add_job_report(
    tx: Transaction, report: JobReport, *, token_id: str | None, size_bytes: int, at: str
) -> int:
    """Store one job report received ``at``, attributed to ``token_id``; its id."""
    cursor = tx.db.execute(
        "INSERT INTO job_reports (at, phase, outcome, workload, fingerprint_digest,"
        " snapshot_id, node, devices, reason_code, reason, new_fxgraph, new_aotautograd,"
        " new_triton, new_other, new_bytes, started_at, finished_at, job, token_id,"
        " size_bytes, tier, snapshot_hits, tier_hits, tier_puts, tier_failed, tier_problem)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            at,
            report.phase,
            report.outcome,
            report.workload,
            report.fingerprint_digest,
            report.snapshot_id,
            report.node,
            json.dumps(list(report.devices)),
            report.reason_code,
            report.reason,
            report.new_fxgraph,
            report.new_aotautograd,
            report.new_triton,
            report.new_other,
            report.new_bytes,
            report.started_at,
            report.finished_at,
            report.job,
            token_id,
            size_bytes,
            report.tier,
            report.snapshot_hits,
            report.tier_hits,
            report.tier_puts,
            report.tier_failed,
            report.tier_problem,
        ],
    )
    return int(cursor.lastrowid or 0)


def restores_by_day(catalog: Catalog, *, days: int = 60) -> list[tuple[str, int]]:
    """(UTC day, prejob restores that day) for the last ``days`` days with any, oldest first."""
    found = catalog.rows(
        f"SELECT substr(at, 1, 10) AS day, COUNT(DISTINCT {_JOB_KEY}) AS n FROM job_reports"
        " WHERE phase = 'prejob' AND outcome IN ('restored', 'already_restored')"
        " GROUP BY day ORDER BY day DESC LIMIT ?",
        [days],
    )
    return [(row["day"], int(row["n"])) for row in reversed(found)]


def job_stats(catalog: Catalog, *, workload: str | None = None) -> list[JobStats]:
    """The job reports added up per (workload, fingerprint digest), sorted by both.

    A report that names a snapshot (a restore, and the post-job after one) counts in
    the row of that snapshot, by its id: the node's own digest may differ from the
    snapshot's in what matching allows (a newer driver), and a report of an older hook
    carries a digest with provenance in it. A report without a snapshot (a cold start),
    or whose snapshot is gone, counts under the digest it carries.

    A job counts once: the reports of one ``job`` on one node (every rank's prejob, a
    postjob run twice) are one restore, cold start or post-job count; a report without
    a ``job`` (older clients) is its own job. The entries and bytes are summed over
    every report (each post-job counts only what appeared since the last one).
    """
    where, params = ("WHERE workload = ?", [workload]) if workload is not None else ("", [])
    # every report, with the digest of the row it counts in (``pair``)
    reports = (
        "(SELECT r.*, COALESCE(s.fingerprint_digest, r.fingerprint_digest) AS pair"
        " FROM job_reports r LEFT JOIN snapshots s"
        " ON s.id = r.snapshot_id AND s.workload = r.workload)"
    )
    restored = "phase = 'prejob' AND outcome IN ('restored', 'already_restored')"
    cold = "phase = 'prejob' AND outcome = 'cold'"
    postjob = "phase = 'postjob'"
    compiled = "phase = 'postjob' AND outcome = 'compiled'"
    after_restore = compiled + " AND snapshot_id IS NOT NULL"
    tiered = "phase = 'postjob' AND tier IS NOT NULL"
    troubled = tiered + " AND tier_problem IS NOT NULL"
    totals = catalog.rows(
        f"SELECT workload, pair, {_jobs(restored)} AS restores,"
        f" {_jobs(cold)} AS cold, {_jobs(postjob)} AS postjobs,"
        f" {_jobs(compiled)} AS compiled, {_jobs(after_restore)} AS compiled_after_restore,"
        # TOTAL (a float), not SUM: sums of what clients report never overflow into a 500
        " TOTAL(CASE WHEN phase = 'postjob' AND snapshot_id IS NOT NULL"
        " THEN new_fxgraph + new_aotautograd ELSE 0 END) AS new_graphs,"
        " TOTAL(CASE WHEN phase = 'postjob' THEN new_bytes ELSE 0 END) AS new_bytes,"
        " COUNT(DISTINCT token_id) AS reporters,"
        f" {_jobs(tiered)} AS tier_jobs, {_jobs(troubled)} AS tier_problems,"
        " TOTAL(CASE WHEN phase = 'postjob' THEN snapshot_hits ELSE 0 END) AS snapshot_hits,"
        " TOTAL(CASE WHEN phase = 'postjob' THEN tier_hits ELSE 0 END) AS tier_hits,"
        " TOTAL(CASE WHEN phase = 'postjob' THEN tier_puts ELSE 0 END) AS tier_puts,"
        " TOTAL(CASE WHEN phase = 'postjob' THEN tier_failed ELSE 0 END) AS tier_failed,"
        f" MAX(at) AS last_report_at FROM {reports} {where}"
        " GROUP BY workload, pair ORDER BY workload, pair",
        params,
    )
    reasons: dict[tuple[str, str], dict[str, int]] = {}
    for row in catalog.rows(
        "SELECT workload, pair, COALESCE(reason_code, 'unknown') AS code,"
        f" COUNT(DISTINCT {_JOB_KEY}) AS n FROM {reports}"
        f" {where + ' AND' if where else 'WHERE'} phase = 'prejob' AND outcome = 'cold'"
        " GROUP BY workload, pair, code",
        params,
    ):
        key = (row["workload"], row["pair"])
        reasons.setdefault(key, {})[row["code"]] = int(row["n"])
    problems: dict[tuple[str, str], str] = {}
    for row in catalog.rows(
        f"SELECT workload, pair, tier_problem FROM {reports}"
        f" {where + ' AND' if where else 'WHERE'} phase = 'postjob'"
        " AND tier_problem IS NOT NULL ORDER BY id",
        params,
    ):
        problems[(row["workload"], row["pair"])] = row["tier_problem"]
    return [
        JobStats(
            workload=row["workload"],
            fingerprint_digest=row["pair"],
            restores=int(row["restores"]),
            cold=int(row["cold"]),
            cold_reasons=reasons.get((row["workload"], row["pair"]), {}),
            postjobs=int(row["postjobs"]),
            compiled=int(row["compiled"]),
            compiled_after_restore=int(row["compiled_after_restore"]),
            new_graphs=int(row["new_graphs"]),
            new_bytes=int(row["new_bytes"]),
            last_report_at=row["last_report_at"],
            reporters=int(row["reporters"]),
            tier_jobs=int(row["tier_jobs"]),
            snapshot_hits=int(row["snapshot_hits"]),
            tier_hits=int(row["tier_hits"]),
            tier_puts=int(row["tier_puts"]),
            tier_failed=int(row["tier_failed"]),
            tier_problems=int(row["tier_problems"]),
            tier_problem=problems.get((row["workload"], row["pair"])),
        )
        for row in totals
    ]
