"""Bounds and retention for every table a client writes into the catalog.

A client that may write a row may write a million: every such table has a bound, checked
in the transaction that writes the row, and a retention, applied by ``prune`` (at start-up
and at most once a minute on the next write). The settings are ``server/settings.py``'s;
docs/server.md ("Budgets") gives the table to operators::

    table          written by                   bound                                retention
    job_reports    any token (read is enough)   per token and window: reports_per_   reports_retention_s
                   to POST /v1/reports          token, report_jobs_per_token (429);
                                                reports_max_rows/_bytes (oldest go)
    agent_events   write (agents)               agent_events_max_rows/_bytes         agent_events_retention_s
                                                (oldest go; 507 when only the newest
                                                of each pair is left)
    agents         write (agents)               max_agents (507); a row's JSON at     agents_retention_s
                                                most AGENT_ROW_BYTES (413)            (unseen this long)
    workloads      write; admin for code        max_workloads (507), each at most     none: an admin removes
                                                max_workload_bytes (413)              them
    snapshots,     write (publish, postjob      max_snapshots (507), a manifest at    GC: LRU down to
    snapshot_blobs --push)                      most max_manifest_bytes (413);        max_store_bytes
                                                max_harvested_deltas per snapshot
                                                and environment (507)
    blobs          write (uploads)              max_blob_bytes each, max_store_bytes  GC (gc_grace_s)
    events         the server, per publish,     events_max_rows (oldest go)           events_retention_s
                   eviction, quarantine
    quarantine     the start-up check           one row per snapshot taken out        none (as snapshots)
    every table    (meta.sqlite itself)         max_catalog_bytes: past it every      retention and GC
                                                client write above is 507             free pages again

(``tier_keys``, the per-key tier's, is bounded by the tier's own settings, server/resources/tier.py.)

Job reports are the one table a read token writes, and the fleet's numbers (the status
page, ``cachekeeper status``) are made of them, so each report is attributed to the token
that sent it (``auth.token_id``) and each token has a budget per window: at most
``reports_per_token`` reports and ``report_jobs_per_token`` new jobs (a job that token
already reported in the window, another rank's prejob or the postjob, is not new). A
token past either is answered 429 ``rate_limited`` with ``retry_after_s``; the hooks treat
a refused report as they treat a server that is down (the job runs on). Why jobs: one job
on one node counts once in the status, so inventing jobs is what skews the numbers (600
reports with made-up job ids made a page show 300 "compiled anyway"); a token can add
at most ``report_jobs_per_token`` of them an hour, however many reports it sends. The
bound is per token, so it holds for a leaked or misbehaving node only if nodes do not all
share one token: docs/operations.md says to give each node group its own, and how to size
the budget of one that a whole fleet shares. With auth off, every caller is one anonymous
reporter with one budget.

Refusals are counted (``cachekeeper_catalog_refusals_total{table,reason}``), and so are the
rows bounds and retention delete (``cachekeeper_catalog_pruned_total{table,reason}``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from cachekeeper.errors import InsufficientStorage, PayloadTooLarge, RateLimited
from cachekeeper.wire import JobReport

from .catalog import BATCH

if TYPE_CHECKING:
    from cachekeeper.snapshot.manifest import Manifest

    from .catalog import Catalog, Transaction
    from .settings import Settings

__all__ = [
    "AGENT_ROW_BYTES",
    "KEPT_EVENTS_SQL",
    "Budgets",
    "catalog_bytes",
    "drop_before",
    "drop_oldest",
    "drop_oldest_bytes",
    "event_bytes",
    "exists",
    "harvested_count",
    "report_bytes",
    "row_count",
    "token_window",
    "usage",
]

_log = logging.getLogger("cachekeeper.server")

AGENT_ROW_BYTES = 64 << 10  # an agent's fingerprint, GPUs and devices as stored, each
PRUNE_EVERY_S = 60.0  # retention runs at most this often (on the next write)
PRUNE_ROWS = 5000  # rows one retention pass deletes per table at most (a bounded pause)
ROOM_EVERY_S = 1.0  # the catalog's size is measured at most this often
ANONYMOUS = "anonymous callers"  # who reports on a server with auth off
# Each (workload, fingerprint digest)'s newest agent event: the status is decided from it,
# so no bound or retention ever removes it.
KEPT_EVENTS_SQL = "SELECT MAX(id) FROM agent_events GROUP BY workload, fingerprint_digest"


def _text_bytes(*values: str | None) -> int:
    return sum(len(v.encode()) for v in values if v)


def report_bytes(report: JobReport) -> int:
    """What a job report's row weighs (``REPORT_BYTES_SQL`` for rows from before the
    budgets: the same sum, less the per-key tier's fields, which those rows never had)."""
    return 160 + _text_bytes(
        report.workload,
        report.node,
        json.dumps(list(report.devices)),
        report.reason,
        report.reason_code,
        report.started_at,
        report.finished_at,
        report.job,
        report.tier,
        report.tier_problem,
    )


def event_bytes(*, workload: str, detail: str, traceback_tail: Iterable[str]) -> int:
    """What an agent event's row weighs (``EVENT_BYTES_SQL``)."""
    return 200 + _text_bytes(workload, detail, json.dumps(list(traceback_tail)))


def _ago(now: datetime, seconds: float) -> str:
    return (now - timedelta(seconds=seconds)).isoformat(timespec="microseconds")


@dataclass
class _Window:
    """One reporter's reports in the current window: (received at, job key), oldest first,
    and how many of them each job has."""

    reports: deque[tuple[str, str]] = field(default_factory=deque)
    jobs: Counter[str] = field(default_factory=Counter)

    def add(self, at: str, job_key: str) -> None:
        self.reports.append((at, job_key))
        self.jobs[job_key] += 1

    def forget_before(self, since: str) -> None:
        while self.reports and self.reports[0][0] < since:
            _at, key = self.reports.popleft()
            self.jobs[key] -= 1
            if not self.jobs[key]:
                del self.jobs[key]


class Budgets:
    """The bounds of the client-written tables, checked inside the writer's transaction."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._refused: Counter[tuple[str, str]] = Counter()
        self._pruned: Counter[tuple[str, str]] = Counter()
        self._pruned_at = float("-inf")  # time.monotonic() of the last retention pass
        self._warned: dict[str, float] = {}  # reporter -> when its refusal was last logged
        self._windows: dict[str | None, _Window] = {}  # reporter (token id) -> its window
        self._measured = (float("-inf"), 0)  # (time.monotonic(), catalog bytes) last measured

    # -- what /metrics shows --------------------------------------------------------------
    def refused(self) -> dict[tuple[str, str], int]:
        """{(table, reason): refusals since start}."""
        with self._lock:
            return dict(self._refused)

    def pruned(self) -> dict[tuple[str, str], int]:
        """{(table, reason): rows deleted by a bound or the retention since start}."""
        with self._lock:
            return dict(self._pruned)

    def _refuse(self, table: str, reason: str) -> None:
        with self._lock:
            self._refused[(table, reason)] += 1

    def _count_pruned(self, tx: Transaction, table: str, reason: str, rows: int) -> None:
        if rows:

            def count() -> None:
                with self._lock:
                    self._pruned[(table, reason)] += rows

            tx.after_commit(count)

    # -- every client write -----------------------------------------------------------------
    def room(self, tx: Transaction, *, table: str) -> None:
        """InsufficientStorage (507) when meta.sqlite is past ``max_catalog_bytes``: measured
        at most once per ``ROOM_EVERY_S`` (what one second of writes adds is small against
        the bound; three PRAGMAs per write were a third of a report's cost)."""
        with self._lock:
            fresh = time.monotonic() - self._measured[0] < ROOM_EVERY_S
            size = self._measured[1]
        if not fresh:
            size = catalog_bytes(tx)
            with self._lock:
                self._measured = (time.monotonic(), size)
        if size > self.settings.max_catalog_bytes:
            self._refuse(table, "catalog_bytes")
            raise InsufficientStorage(
                f"the server's catalog (meta.sqlite) holds {size} bytes, over its"
                f" max_catalog_bytes of {self.settings.max_catalog_bytes}: nothing is added to"
                f" {table} until GC or retention frees room (or the operator raises the bound)",
                extra={"table": table},
            )

    # -- job reports ----------------------------------------------------------------------
    def admit_report(
        self, tx: Transaction, report: JobReport, *, token_id: str | None, at: str
    ) -> Callable[[int], None]:
        """Check the reporter's budgets and make room in the table. RateLimited (429) past
        a token's budget for the window. Returns what to call with the stored report's id
        (it counts the report in the token's window once the transaction commits)."""
        self.room(tx, table="job_reports")
        settings = self.settings
        now = datetime.fromisoformat(at)
        since = _ago(now, settings.reports_window_s)
        window = self._window(tx, token_id, since=since)
        reports, jobs = len(window.reports), len(window.jobs)
        oldest = window.reports[0][0] if window.reports else None
        job_key = None if report.job is None else f"{report.node}|{report.job}"
        new_job = job_key is None or job_key not in window.jobs
        who = token_id or ANONYMOUS
        span = f"{settings.reports_window_s:g} s"
        if reports >= settings.reports_per_token:
            self._over(
                who,
                "reports_per_token",
                f"{who} filed {reports} job reports in the last {span}, its budget"
                f" (reports_per_token)",
                oldest=oldest,
                now=now,
            )
        if new_job and jobs >= settings.report_jobs_per_token:
            self._over(
                who,
                "report_jobs_per_token",
                f"{who} reported {jobs} jobs in the last {span}, its budget of new jobs"
                " (report_jobs_per_token; more reports on those jobs are still taken)",
                oldest=oldest,
                now=now,
            )
        size = report_bytes(report)
        rows, stored = usage(tx, "job_reports")
        over_rows = rows + 1 - settings.reports_max_rows
        if over_rows > 0:
            gone = drop_oldest(tx, "job_reports", rows=over_rows)
            self._count_pruned(tx, "job_reports", "max_rows", gone)
        over_bytes = stored + size - settings.reports_max_bytes
        if over_bytes > 0:
            gone = drop_oldest_bytes(tx, "job_reports", over_bytes=over_bytes)
            self._count_pruned(tx, "job_reports", "max_bytes", gone)

        def stored_as(report_id: int) -> None:
            key = job_key if job_key is not None else f"report:{report_id}"
            tx.after_commit(lambda: window.add(at, key))

        return stored_as

    def _window(self, tx: Transaction, token_id: str | None, *, since: str) -> _Window:
        """The reporter's window, read from the catalog the first time (a restart keeps
        the budgets), then kept here: a count per report costs nothing however many the
        window holds (counting them in SQL took 12 ms per report at 1,000 in the window,
        0.6 s at 20,000). Only ever used under the catalog's write lock."""
        window = self._windows.get(token_id)
        if window is None:
            window = _Window()
            for at, key in token_window(tx, token_id, since=since):
                window.add(at, key)
            self._windows[token_id] = window  # only once read whole
        window.forget_before(since)
        return window

    def _over(self, who: str, budget: str, said: str, *, oldest: str | None, now: datetime) -> None:
        self._refuse("job_reports", budget)
        window = self.settings.reports_window_s
        retry = window
        if oldest is not None:
            retry = max(1.0, window - (now - datetime.fromisoformat(oldest)).total_seconds())
        with self._lock:
            last = self._warned.get(who)
            log = last is None or time.monotonic() - last >= window
            if log:
                self._warned[who] = time.monotonic()
        if log:  # once per reporter and window: a flood never floods the log
            _log.warning("job reports refused: %s (raise %s if that is the fleet's)", said, budget)
        raise RateLimited(
            f"{said}; retry in {retry:.0f} s",
            extra={"budget": budget, "retry_after_s": round(retry)},
        )

    # -- agents and their events -------------------------------------------------------------
    def admit_agent(
        self, tx: Transaction, *, agent_id: str, fields: dict[str, Any], now: datetime
    ) -> None:
        """A registration: each JSON field within AGENT_ROW_BYTES (413), a new agent only
        below ``max_agents`` once agents unseen for the retention are gone (507)."""
        for name, value in fields.items():
            size = len(json.dumps(value, sort_keys=True))
            if size > AGENT_ROW_BYTES:
                self._refuse("agents", "row_bytes")
                raise PayloadTooLarge(
                    f"agent registration: {name} is {size} bytes as JSON; at most"
                    f" {AGENT_ROW_BYTES} are stored per agent"
                )
        if exists(tx, "agents", "id", agent_id):
            return
        self.room(tx, table="agents")
        if row_count(tx, "agents") < self.settings.max_agents:
            return
        self._prune_agents(tx, now=now)
        if row_count(tx, "agents") >= self.settings.max_agents:
            self._refuse("agents", "max_rows")
            raise InsufficientStorage(
                f"the server holds {self.settings.max_agents} agents (max_agents): a new one is"
                " registered once one is removed (agents unseen for agents_retention_s are)",
                extra={"table": "agents"},
            )

    def admit_agent_event(self, tx: Transaction, *, size_bytes: int) -> None:
        """Make room for one event: the oldest go, never a pair's newest (507 when only
        those are left)."""
        self.room(tx, table="agent_events")
        settings = self.settings
        rows, stored = usage(tx, "agent_events")
        over_rows = rows + 1 - settings.agent_events_max_rows
        if over_rows > 0:
            gone = drop_oldest(tx, "agent_events", rows=over_rows, keep_sql=KEPT_EVENTS_SQL)
            self._count_pruned(tx, "agent_events", "max_rows", gone)
        over_bytes = stored + size_bytes - settings.agent_events_max_bytes
        if over_bytes > 0:
            gone = drop_oldest_bytes(
                tx, "agent_events", over_bytes=over_bytes, keep_sql=KEPT_EVENTS_SQL
            )
            self._count_pruned(tx, "agent_events", "max_bytes", gone)
        rows, stored = usage(tx, "agent_events")
        if rows + 1 > settings.agent_events_max_rows or (
            stored + size_bytes > settings.agent_events_max_bytes
        ):
            self._refuse("agent_events", "max_rows")
            raise InsufficientStorage(
                f"agent_events holds {rows} events of {stored} bytes, each the newest of its"
                " (workload, fingerprint) pair: past agent_events_max_rows/_bytes, no event is"
                " added until agents or workloads are removed",
                extra={"table": "agent_events"},
            )

    # -- workloads and snapshots -------------------------------------------------------------
    def admit_workload(self, tx: Transaction, *, name: str) -> None:
        """507 for a new workload name past ``max_workloads`` (replacing one is fine)."""
        if exists(tx, "workloads", "name", name):
            return
        self.room(tx, table="workloads")
        if row_count(tx, "workloads") >= self.settings.max_workloads:
            self._refuse("workloads", "max_rows")
            raise InsufficientStorage(
                f"the server holds {self.settings.max_workloads} workloads (max_workloads):"
                f" {name!r} is registered once one is deleted",
                extra={"table": "workloads"},
            )

    def admit_snapshot(self, tx: Transaction, manifest: Manifest) -> None:
        """507 for a new snapshot past ``max_snapshots``, or a harvested delta past
        ``max_harvested_deltas`` for its snapshot and environment."""
        if exists(tx, "snapshots", "id", manifest.id):
            return
        self.room(tx, table="snapshots")
        settings = self.settings
        if row_count(tx, "snapshots") >= settings.max_snapshots:
            self._refuse("snapshots", "max_rows")
            raise InsufficientStorage(
                f"the server holds {settings.max_snapshots} snapshots (max_snapshots): run GC"
                " (cachekeeper snapshots gc) or remove some (cachekeeper snapshots rm) first",
                extra={"table": "snapshots"},
            )
        if manifest.parent is not None and manifest.source == "harvest":
            held = harvested_count(
                tx, manifest.parent, fingerprint_digest=manifest.fingerprint_digest
            )
            if held >= settings.max_harvested_deltas:
                self._refuse("snapshots", "max_harvested_deltas")
                raise InsufficientStorage(
                    f"snapshot {manifest.parent[:12]} already has {held} harvested deltas for"
                    f" this environment (max_harvested_deltas): an agent's promotion folds them"
                    " into a new snapshot; or remove some (cachekeeper snapshots rm)",
                    extra={"table": "snapshots"},
                )

    # -- retention --------------------------------------------------------------------------
    def prune_due(self) -> bool:
        """Whether a retention pass is due (at most one per ``PRUNE_EVERY_S``)."""
        with self._lock:
            if time.monotonic() - self._pruned_at < PRUNE_EVERY_S:
                return False
            self._pruned_at = time.monotonic()
            return True

    def retain(self, catalog: Catalog, *, force: bool = False) -> dict[str, int]:
        """A retention pass over the client-written tables when one is due (``force``:
        now), in its own transaction; {table: rows deleted}. Called at start-up and before
        each client write (a publish, a registration, a report)."""
        due = self.prune_due()  # first: a forced pass restarts the minute too
        if not (due or force):
            return {}
        with catalog.writing() as tx:
            return self.prune(tx)

    def prune(self, tx: Transaction, *, now: datetime | None = None) -> dict[str, int]:
        """One retention pass (at most ``PRUNE_ROWS`` rows per table): {table: rows deleted}."""
        now = now or datetime.now(UTC)
        settings = self.settings
        done = {
            "job_reports": drop_before(
                tx,
                "job_reports",
                column="at",
                cutoff=_ago(now, settings.reports_retention_s),
                limit=PRUNE_ROWS,
            ),
            "agent_events": drop_before(
                tx,
                "agent_events",
                column="at",
                cutoff=_ago(now, settings.agent_events_retention_s),
                limit=PRUNE_ROWS,
                keep_sql=KEPT_EVENTS_SQL,
            ),
            "agents": self._prune_agents(tx, now=now),
            "events": drop_before(
                tx,
                "events",
                column="at",
                cutoff=_ago(now, settings.events_retention_s),
                limit=PRUNE_ROWS,
            ),
        }
        for table, rows in list(done.items()):
            if table != "agents":  # _prune_agents counted its own
                self._count_pruned(tx, table, "retention", rows)
        over = row_count(tx, "events") - settings.events_max_rows
        if over > 0:
            gone = drop_oldest(tx, "events", rows=min(over, PRUNE_ROWS))
            self._count_pruned(tx, "events", "max_rows", gone)
            done["events"] += gone
        return done

    def _prune_agents(self, tx: Transaction, *, now: datetime) -> int:
        gone = drop_before(
            tx,
            "agents",
            column="last_seen_at",
            cutoff=_ago(now, self.settings.agents_retention_s),
            limit=PRUNE_ROWS,
        )
        self._count_pruned(tx, "agents", "retention", gone)
        return gone


# -- the queries: counts and deletes ---------------------------------------------------------
# What each client-written table holds, what one token filed in a window, and the deletes
# that keep each table within its bound and retention. Deletes go oldest first (by rowid,
# the order of insertion, whatever the clock said) in batches of ``BATCH`` rows, so one
# pass holds the write lock for a bounded time. All run inside one ``Catalog.writing()``.


def usage(tx: Transaction, table: str) -> tuple[int, int]:
    """(rows, bytes) of ``job_reports`` or ``agent_events`` (``table_usage``)."""
    row = tx.db.execute("SELECT rows, bytes FROM table_usage WHERE name = ?", [table])
    found = row.fetchone()
    return (0, 0) if found is None else (int(found[0]), int(found[1]))


def row_count(tx: Transaction, table: str) -> int:
    """Rows of a small table (agents, workloads, snapshots): one pass over its smallest index."""
    return int(tx.one(f"SELECT COUNT(*) FROM {table}"))


def catalog_bytes(tx: Transaction) -> int:
    """The database's size in bytes less its free pages (WAL content included)."""
    page = int(tx.one("PRAGMA page_size"))
    return page * (int(tx.one("PRAGMA page_count")) - int(tx.one("PRAGMA freelist_count")))


def exists(tx: Transaction, table: str, column: str, value: str) -> bool:
    return tx.one(f"SELECT 1 FROM {table} WHERE {column} = ?", [value]) is not None


def token_window(tx: Transaction, token_id: str | None, *, since: str) -> list[tuple[str, str]]:
    """(received at, job key) of each report ``token_id`` (None: the anonymous callers
    of a server with auth off) filed at or after ``since``, oldest first. The job key
    is the status's (``node|job``; ``report:<id>`` for a report without a job)."""
    rows = tx.db.execute(
        "SELECT at, CASE WHEN job IS NULL THEN 'report:' || id ELSE node || '|' || job END"
        " FROM job_reports WHERE at >= ? AND token_id IS ? ORDER BY at, id",
        [since, token_id],
    )
    return [(str(r[0]), str(r[1])) for r in rows]


def harvested_count(tx: Transaction, parent: str, *, fingerprint_digest: str) -> int:
    sql = (
        "SELECT COUNT(*) FROM snapshots WHERE parent = ? AND source = 'harvest'"
        " AND fingerprint_digest = ?"
    )
    return int(tx.one(sql, [parent, fingerprint_digest]))


def drop_oldest(tx: Transaction, table: str, *, rows: int, keep_sql: str | None = None) -> int:
    """Delete up to ``rows`` of ``table``'s oldest rows (not those ``keep_sql`` selects
    by id); the number deleted."""
    keep = f" WHERE id NOT IN ({keep_sql})" if keep_sql else ""
    gone = 0
    while gone < rows:
        step = min(BATCH, rows - gone)
        cursor = tx.db.execute(
            f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table}{keep} ORDER BY id LIMIT ?)",
            [step],
        )
        gone += cursor.rowcount
        if cursor.rowcount < step:
            break
    return gone


def drop_before(
    tx: Transaction,
    table: str,
    *,
    column: str,
    cutoff: str,
    limit: int,
    keep_sql: str | None = None,
) -> int:
    """Delete up to ``limit`` rows of ``table`` whose ``column`` is before ``cutoff``,
    oldest first (not those ``keep_sql`` selects by rowid); the number deleted. An index
    on ``column`` makes it cost what it deletes, not the table's size."""
    keep = f" AND rowid NOT IN ({keep_sql})" if keep_sql else ""
    cursor = tx.db.execute(
        f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table}"
        f" WHERE {column} < ?{keep} ORDER BY {column} LIMIT ?)",
        [cutoff, limit],
    )
    return int(cursor.rowcount)


def drop_oldest_bytes(
    tx: Transaction, table: str, *, over_bytes: int, keep_sql: str | None = None
) -> int:
    """Delete ``table``'s oldest rows until ``over_bytes`` of ``size_bytes`` are gone (or
    none is left to delete); the number deleted."""
    keep = f" AND id NOT IN ({keep_sql})" if keep_sql else ""
    gone = 0
    freed = 0
    while freed < over_bytes:
        rows = tx.db.execute(
            f"SELECT id, COALESCE(size_bytes, 0) FROM {table} WHERE 1{keep} ORDER BY id LIMIT ?",
            [BATCH],
        ).fetchall()
        if not rows:
            break
        chosen = []
        for row_id, size in rows:
            chosen.append(row_id)
            freed += int(size)
            if freed >= over_bytes:
                break
        marks = ",".join("?" * len(chosen))
        gone += tx.db.execute(f"DELETE FROM {table} WHERE id IN ({marks})", chosen).rowcount
    return gone
