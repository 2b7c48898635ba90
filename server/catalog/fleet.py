"""The catalog's fleet queries: agents (registrations, heartbeats, build events), job
reports, and the facts the fleet status is decided from (``server/resources/fleet.py``).

The rest of the catalog (snapshots, blobs, workloads, the start-up check) is in
``server/catalog/database.py``, whose ``Catalog`` and ``Transaction`` mix these classes in:
callers import only ``server.catalog``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from cachekeeper.server.records import StatusFacts

from cachekeeper.fingerprint import Fingerprint
from cachekeeper.wire import AgentInfo, EventOut, EventStatus, JobReport, JobStats, utc_now

from .base import Reads, Writes, chunks

__all__ = ["FleetReads", "FleetWrites", "agent_id_for"]


def agent_id_for(name: str) -> str:
    """The id of the agent named ``name``: one agent per name, whatever its environment (a
    changed environment updates the agent; it is not a second one). Before issue 31 the id
    also hashed the fingerprint digest, so an agent started again in another shell showed
    up twice under one name."""
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def _agent(row: dict[str, Any]) -> AgentInfo:
    info = json.loads(row["info"] or "{}")
    return AgentInfo(
        id=row["id"],
        name=row["name"],
        fingerprint_digest=row["fingerprint_digest"],
        fingerprint=json.loads(row["fingerprint"]),
        devices=tuple(json.loads(row["devices"] or "[]")),
        gpus=tuple(info.get("gpus") or ()),
        version=info.get("version") or "",
        registered_at=row["registered_at"],
        last_seen_at=row["last_seen_at"],
    )


def _event(row: dict[str, Any]) -> EventOut:
    return EventOut(
        id=row["id"],
        at=row["at"],
        agent_id=row["agent_id"],
        workload=row["workload"],
        fingerprint_digest=row["fingerprint_digest"],
        status=row["status"],
        detail=row["detail"] or "",
        traceback_tail=json.loads(row["traceback_tail"] or "[]"),
        snapshot_id=row["snapshot_id"],
        seconds=row["seconds"],
    )


# One job on one node: its reports share ``job`` (a report without one is its own job).
_JOB_KEY = "CASE WHEN job IS NULL THEN 'report:' || id ELSE node || '|' || job END"


def _jobs(condition: str) -> str:
    """SQL counting the distinct jobs among the reports that meet ``condition``."""
    return f"COUNT(DISTINCT CASE WHEN {condition} THEN {_JOB_KEY} END)"


class FleetWrites(Writes):
    """Agents and job reports: the writes (mixed into ``catalog.Transaction``)."""

    def register_agent(
        self,
        *,
        name: str,
        fingerprint: Fingerprint,
        fingerprint_digest: str,
        devices: list[str],
        gpus: list[dict[str, Any]],
        version: str,
    ) -> tuple[str, bool]:
        """(agent id, created): insert the agent, or refresh its environment, devices,
        GPUs, version and ``last_seen_at``. ``registered_at`` is when the agent registered
        its current environment: it moves only when the fingerprint digest changes (what
        it reported under the one before is then out of date: server/resources/fleet.py)."""
        agent_id = agent_id_for(name)
        now = utc_now()
        created = self._one("SELECT 1 FROM agents WHERE id = ?", [agent_id]) is None
        self.db.execute(
            "INSERT INTO agents (id, name, fingerprint_digest, fingerprint, devices,"
            " registered_at, last_seen_at, info) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(id) DO UPDATE SET devices = excluded.devices,"
            " last_seen_at = excluded.last_seen_at, info = excluded.info,"
            " registered_at = CASE WHEN fingerprint_digest = excluded.fingerprint_digest"
            " THEN registered_at ELSE excluded.registered_at END,"
            " fingerprint_digest = excluded.fingerprint_digest,"
            " fingerprint = excluded.fingerprint",
            [
                agent_id,
                name,
                fingerprint_digest,
                json.dumps(fingerprint, sort_keys=True),
                json.dumps(devices),
                now,
                now,
                json.dumps({"gpus": gpus, "version": version}, sort_keys=True),
            ],
        )
        return agent_id, created

    def agent_seen(self, agent_id: str, *, at: str | None = None) -> bool:
        """Set the agent's ``last_seen_at``; False when no such agent."""
        sql = "UPDATE agents SET last_seen_at = ? WHERE id = ?"
        return self.db.execute(sql, [at or utc_now(), agent_id]).rowcount > 0

    def add_agent_event(
        self,
        agent_id: str,
        *,
        workload: str,
        fingerprint_digest: str,
        status: EventStatus,
        detail: str,
        traceback_tail: list[str],
        snapshot_id: str | None,
        seconds: float | None,
        size_bytes: int = 0,
    ) -> EventOut | None:
        """Record one report (also a heartbeat); None when the agent is not registered."""
        now = utc_now()
        if not self.agent_seen(agent_id, at=now):
            return None
        cursor = self.db.execute(
            "INSERT INTO agent_events (at, agent_id, workload, fingerprint_digest, status,"
            " detail, traceback_tail, snapshot_id, seconds, size_bytes)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                now,
                agent_id,
                workload,
                fingerprint_digest,
                status,
                detail,
                json.dumps(traceback_tail),
                snapshot_id,
                seconds,
                size_bytes,
            ],
        )
        return EventOut(
            id=int(cursor.lastrowid or 0),
            at=now,
            agent_id=agent_id,
            workload=workload,
            fingerprint_digest=fingerprint_digest,
            status=status,
            detail=detail,
            traceback_tail=list(traceback_tail),
            snapshot_id=snapshot_id,
            seconds=seconds,
        )

    def add_job_report(
        self, report: JobReport, *, token_id: str | None, size_bytes: int, at: str
    ) -> int:
        """Store one job report received ``at``, attributed to ``token_id``; its id."""
        cursor = self.db.execute(
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


class FleetReads(Reads):
    """Agents, job reports, fleet facts: the reads (mixed into ``catalog.Catalog``)."""

    def restores_by_day(self, *, days: int = 60) -> list[tuple[str, int]]:
        """(UTC day, prejob restores that day) for the last ``days`` days with any, oldest first."""
        found = self._rows(
            f"SELECT substr(at, 1, 10) AS day, COUNT(DISTINCT {_JOB_KEY}) AS n FROM job_reports"
            " WHERE phase = 'prejob' AND outcome IN ('restored', 'already_restored')"
            " GROUP BY day ORDER BY day DESC LIMIT ?",
            [days],
        )
        return [(row["day"], int(row["n"])) for row in reversed(found)]

    def agent(self, agent_id: str) -> AgentInfo | None:
        found = self._rows("SELECT * FROM agents WHERE id = ?", [agent_id])
        return _agent(found[0]) if found else None

    def list_agents(self) -> list[AgentInfo]:
        rows = self._rows("SELECT * FROM agents ORDER BY last_seen_at DESC, id")
        return [_agent(r) for r in rows]

    def job_stats(self, *, workload: str | None = None) -> list[JobStats]:
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
        totals = self._rows(
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
        for row in self._rows(
            "SELECT workload, pair, COALESCE(reason_code, 'unknown') AS code,"
            f" COUNT(DISTINCT {_JOB_KEY}) AS n FROM {reports}"
            f" {where + ' AND' if where else 'WHERE'} phase = 'prejob' AND outcome = 'cold'"
            " GROUP BY workload, pair, code",
            params,
        ):
            key = (row["workload"], row["pair"])
            reasons.setdefault(key, {})[row["code"]] = int(row["n"])
        problems: dict[tuple[str, str], str] = {}
        for row in self._rows(
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

    def status_facts(self) -> StatusFacts:
        """What ``server.fleet`` decides each (workload, fingerprint digest)'s status from."""
        with self.reading():
            return self._status_facts()

    def _status_facts(self) -> StatusFacts:
        workload_rows = self._rows("SELECT name, digest FROM workloads ORDER BY name")
        workloads = tuple(r["name"] for r in workload_rows)
        agent_rows = self._rows(
            "SELECT id, name, fingerprint_digest, last_seen_at, registered_at FROM agents"
            " ORDER BY name, id"
        )
        agents = tuple((r["name"], r["fingerprint_digest"]) for r in agent_rows)
        latest = [
            _event(r)
            for r in self._rows(
                "SELECT e.* FROM agent_events e JOIN (SELECT MAX(id) AS id FROM agent_events"
                " GROUP BY workload, fingerprint_digest) m ON e.id = m.id"
            )
        ]
        verified: dict[tuple[str, str], tuple[str, str]] = {}
        unverified: dict[tuple[str, str], tuple[str, str]] = {}
        covers: dict[str, tuple[str, ...]] = {}
        built_for: dict[str, str | None] = {}
        for snap in self._rows(  # harvested deltas are never a pair's snapshot
            "SELECT id, workload, fingerprint_digest, created_at, devices, workload_digest,"
            " verified FROM snapshots WHERE workload IS NOT NULL AND source IS NOT 'harvest'"
            " ORDER BY rowid"  # publication order
        ):
            key = (snap["workload"], snap["fingerprint_digest"])
            newest = verified if snap["verified"] else unverified
            newest[key] = (snap["id"], snap["created_at"])  # newest wins
            covers[snap["id"]] = tuple(json.loads(snap["devices"] or "[]"))
            built_for[snap["id"]] = snap["workload_digest"]
        named = sorted({e.snapshot_id for e in latest if e.snapshot_id})
        stored: set[str] = set()
        for part, marks in chunks(named):
            sql = f"SELECT id, devices, workload_digest FROM snapshots WHERE id IN ({marks})"
            for r in self._rows(sql, part):
                stored.add(r["id"])
                covers[r["id"]] = tuple(json.loads(r["devices"] or "[]"))
                built_for[r["id"]] = r["workload_digest"]
        harvested = {
            (r["workload"], r["fingerprint_digest"]): int(r["n"])
            for r in self._rows(
                "SELECT workload, fingerprint_digest, COUNT(*) AS n FROM snapshots"
                " WHERE source = 'harvest' AND workload IS NOT NULL"
                " GROUP BY workload, fingerprint_digest"
            )
        }
        vouched = {d for _name, d in agents}
        vouched.update(
            r["fingerprint_digest"]
            for r in self._rows("SELECT DISTINCT fingerprint_digest FROM snapshots")
        )
        return StatusFacts(
            vouched=frozenset(vouched),
            workloads=workloads,
            agents=agents,
            latest={(e.workload, e.fingerprint_digest): e for e in latest},
            verified=verified,
            stored=frozenset(stored),
            covers=covers,
            jobs={(j.workload, j.fingerprint_digest): j for j in self.job_stats()},
            harvested=harvested,
            unverified=unverified,
            agent_of={r["id"]: (r["name"], r["fingerprint_digest"]) for r in agent_rows},
            agent_seen={r["id"]: r["last_seen_at"] for r in agent_rows},
            agent_since={r["id"]: r["registered_at"] for r in agent_rows},
            workload_digests={r["name"]: r["digest"] for r in workload_rows},
            built_for=built_for,
        )
