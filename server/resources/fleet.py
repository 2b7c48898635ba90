"""The fleet's status: one row per (workload, fingerprint digest), decided from the catalog.

``GET /v1/status`` answers one row per (workload, fingerprint digest) the server knows of:
every registered workload for every registered agent's fingerprint, plus any pair an
event or a snapshot of a registered workload names (harvested deltas aside). Its ``status`` is decided by the newest fact about the
pair, an agent's report or the publication of a verified snapshot with that exact
fingerprint digest:

- ``building``: the newest fact is an agent's ``building`` report (see ``last_event.at``
  and the agent's ``last_seen_at`` to tell a build in progress from an agent that died);
- ``warm``: the newest fact is a verified snapshot (an unverified one where the pair has
  none: resolve answers it then; the page shows which), or a ``built``/``skipped`` report
  whose snapshot is still stored;
- ``broken``: the newest report is ``cold_compile_broken`` (the workload raised during a
  cold compile: exactly what a warm cache would hide);
- ``failed``: the newest report is ``failed`` (crash, timeout, verify not effective,
  push failed, abandoned on shutdown);
- ``refused``: the newest report is ``refused``: the agent's allowlist (``agent --allow``)
  does not admit the workload's command or import path, so it runs nothing (the event's
  ``detail`` names what);
- ``missing``: nothing was built for the pair (or the snapshot a report named is gone).

A pair whose newest fact is an agent's report is dropped when the pair holds no snapshot
and no job report and either the same agent reported on the same workload later under
another digest (a command's processes compile under the CPU state their launcher gives
them, which the agent learns only by running them, so its first report, ``refused``,
``building`` or a failure, can name the digest of its own children and the next ones the
digest of what the command built), or the agent's environment changed since the report
(it registered another fingerprint after it: an agent is one per name, and its
``registered_at`` is when its current environment began). A ``refused`` or ``failed`` row
of an environment the builder left says nothing about any environment it builds now.

``stale`` says, on a ``warm`` or ``building`` row, why that state is out of date: the
registered workload's digest is not the one its snapshot was built from (the workload file
changed since: the agent rebuilds it; an identical re-registration changes nothing), or
the agent that reported the build has not been seen for ``STALE_AFTER_S`` (it likely died
mid-build). The JSON, ``cachekeeper status`` and the status page all show it.

Each row also says which devices its warm snapshot covers (``devices``); given the
training nodes' devices, the ones it does not cover (``uncovered``) and a ``note``.

``harvested`` counts the pair's harvested deltas (``postjob --push``), and ``harvest_note``
says plainly whether nodes get them: a server run with ``serve_harvested`` offers them
after the snapshot; otherwise no node does, and only an agent's own rebuild (a workload
with a ``[[command]]``, whose run compiles the same entries: ``cachekeeper.builder.harvest``)
turns them into a snapshot nodes get, with the builder's bytes.

``jobs`` adds up what training jobs reported for the pair (``POST /v1/reports``; a pair a
report names is a row when its workload is registered and its fingerprint digest is one
an agent registered or a stored snapshot records, since anyone with a read token can
report any digest): restores, cold starts by reason, jobs that compiled anyway. ``jobs_note`` says when restored jobs compiled anyway: the
workload file does not match training.

The facts are read at one time by ``status_facts`` (this module's queries, over the
workloads, agents, events, snapshots and job reports: they are the fleet's, read-only);
``Fleet.status`` decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from cachekeeper.environment.devices import coverage_advice
from cachekeeper.server.catalog import Catalog, chunks
from cachekeeper.server.settings import Settings
from cachekeeper.wire import EventOut, JobStats, StatusRow

from .agents import event_of
from .reports import job_stats

__all__ = ["STALE_AFTER_S", "Fleet", "StatusFacts", "fleet_status", "status_facts"]

STALE_AFTER_S = 15 * 60  # a building agent silent this long likely died mid-build


@dataclass(frozen=True)
class StatusFacts:
    """Everything the fleet status is decided from, read at one time."""

    workloads: tuple[str, ...]  # registered workload names
    agents: tuple[tuple[str, str], ...]  # (name, fingerprint_digest), by name
    latest: dict[tuple[str, str], EventOut]  # newest event per (workload, digest)
    verified: dict[tuple[str, str], tuple[str, str]]  # newest (id, created_at) per pair
    stored: frozenset[str]  # snapshot ids named by ``latest`` that still exist
    covers: dict[str, tuple[str, ...]]  # devices of those and of the verified snapshots
    jobs: dict[tuple[str, str], JobStats]  # what jobs reported, per (workload, digest)
    harvested: dict[tuple[str, str], int] = field(default_factory=dict)  # deltas per pair
    unverified: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)  # as verified
    agent_of: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (name, digest)
    agent_seen: dict[str, str] = field(default_factory=dict)  # id -> last_seen_at
    # id -> registered_at: when the agent's current environment began (an event before it
    # was reported under an environment the agent has left)
    agent_since: dict[str, str] = field(default_factory=dict)
    workload_digests: dict[str, str] = field(default_factory=dict)  # name -> registered digest
    built_for: dict[str, str | None] = field(
        default_factory=dict
    )  # snapshot -> its workload digest
    # Fingerprint digests an agent registered or a stored snapshot records: job reports
    # (read scope) add a row only for these, so random fingerprints add no environments.
    vouched: frozenset[str] = frozenset()


class Fleet:
    """The fleet's status as the routes and the status page see it."""

    def __init__(self, *, settings: Settings, catalog: Catalog) -> None:
        self.settings = settings
        self.catalog = catalog

    def status(
        self,
        *,
        workload: str | None = None,
        fingerprint_digest: str | None = None,
        devices: list[str] | None = None,
    ) -> list[StatusRow]:
        return fleet_status(
            status_facts(self.catalog),
            workload=workload,
            fingerprint_digest=fingerprint_digest,
            devices=devices,
            serve_harvested=self.settings.serve_harvested,
        )


def _stale(
    facts: StatusFacts,
    workload: str,
    status: str,
    snapshot_id: str | None,
    event: EventOut | None,
    now: datetime,
) -> str | None:
    """Why the row's ``warm`` / ``building`` state is out of date, or None."""
    if status == "warm" and snapshot_id is not None:
        built, registered = facts.built_for.get(snapshot_id), facts.workload_digests.get(workload)
        if built and registered and built != registered:
            return (
                f"the workload file changed since snapshot {snapshot_id[:12]} was built"
                f" (built from {built[:12]}, registered now: {registered[:12]});"
                " an agent of this environment rebuilds it"
            )
    if status == "building" and event is not None:
        seen = facts.agent_seen.get(event.agent_id)
        if seen and now - datetime.fromisoformat(seen) > timedelta(seconds=STALE_AFTER_S):
            return f"building, but its agent has not been seen since {seen[:19]}"
    return None


def _decide(
    event: EventOut | None, verified: tuple[str, str] | None, stored: frozenset[str]
) -> tuple[str, str | None, str | None]:
    """(status, warm snapshot id, updated_at) from the newest event and verified snapshot."""
    snap_at = verified[1] if verified else None
    if event is None or (snap_at is not None and snap_at > event.at):
        if verified is None:
            return "missing", None, None
        return "warm", verified[0], snap_at
    if event.status == "building":
        return "building", None, event.at
    if event.status in ("built", "skipped"):
        if event.snapshot_id in stored:
            return "warm", event.snapshot_id, event.at
        if verified is not None:
            return "warm", verified[0], event.at
        return "missing", None, event.at
    decided = {"cold_compile_broken": "broken", "refused": "refused"}
    return decided.get(event.status, "failed"), None, event.at


def fleet_status(
    facts: StatusFacts,
    *,
    workload: str | None = None,
    fingerprint_digest: str | None = None,
    devices: list[str] | None = None,
    serve_harvested: bool = False,
    now: datetime | None = None,
) -> list[StatusRow]:
    """The status rows (see the module docstring), sorted by workload then digest.

    ``devices``: the devices training nodes use; rows then say what they leave uncovered.
    ``serve_harvested``: the server's setting, which decides ``harvest_note``.
    ``now``: the time staleness is judged at (default: now).
    """
    now = now or datetime.now(UTC)
    names_by_digest: dict[str, list[str]] = {}
    for name, digest in facts.agents:
        names_by_digest.setdefault(digest, []).append(name)
    pairs = {(w, d) for w in facts.workloads for d in names_by_digest}
    # An agent builds a workload under the fingerprint its children compile with (the
    # workload's [process] omp_num_threads changes the CPU part), and its events name that
    # digest: the workload's row is that one, not a "missing" row of the agent's own.
    builders: dict[tuple[str, str], set[str]] = {}
    for (w, d), newest in facts.latest.items():
        if newest.agent_id not in facts.agent_of or _left(facts, newest):
            continue
        builder, own = facts.agent_of[newest.agent_id]
        builders.setdefault((w, d), set()).add(builder)
        if own != d and (w, own) not in facts.latest:
            pairs.discard((w, own))
    pairs |= set(facts.latest)
    pairs |= {key for key in facts.verified if key[0] in facts.workloads}
    pairs |= {key for key in facts.unverified if key[0] in facts.workloads}
    # Job reports need only a read token: they add a row only for an environment an agent
    # or a stored snapshot vouches for (random fingerprints must not flood the status).
    pairs |= {key for key in facts.jobs if key[0] in facts.workloads and key[1] in facts.vouched}
    pairs -= _superseded(facts)
    rows = []
    for w, d in sorted(pairs):
        if (workload is not None and w != workload) or (
            fingerprint_digest is not None and d != fingerprint_digest
        ):
            continue
        event = facts.latest.get((w, d))
        # resolve prefers a verified snapshot, and answers an unverified one when it is all
        # there is (a push of a dir nobody prewarmed): that pair is warm too, and says so
        best = facts.verified.get((w, d)) or facts.unverified.get((w, d))
        status, snapshot_id, updated_at = _decide(event, best, facts.stored)
        covered = list(facts.covers.get(snapshot_id or "", ()))
        uncovered = [x for x in devices or [] if x not in covered] if snapshot_id else []
        note = coverage_advice(covered=covered, wanted=devices, who="a node") if uncovered else None
        rows.append(
            StatusRow(
                workload=w,
                fingerprint_digest=d,
                status=status,  # type: ignore[arg-type]  # one of PairStatus, by _decide
                snapshot_id=snapshot_id,
                updated_at=updated_at,
                last_event=event,
                agents=tuple(sorted(set(names_by_digest.get(d, [])) | builders.get((w, d), set()))),
                devices=tuple(covered),
                uncovered=tuple(uncovered),
                note=note,
                jobs=facts.jobs.get((w, d)),
                jobs_note=facts.jobs[(w, d)].mismatch_note if (w, d) in facts.jobs else None,
                harvested=facts.harvested.get((w, d), 0),
                harvest_note=harvest_note(
                    facts.harvested.get((w, d), 0), serve_harvested=serve_harvested
                ),
                stale=_stale(facts, w, status, snapshot_id, event, now),
            )
        )
    return rows


def harvest_note(count: int, *, serve_harvested: bool) -> str | None:
    """Whether nodes get a pair's ``count`` harvested deltas, in one sentence (None: none)."""
    if not count:
        return None
    what = f"{count} harvested delta{'s' if count != 1 else ''}"
    if serve_harvested:
        return f"{what} (postjob --push): offered to nodes after the snapshot"
    return (
        f"{what} (postjob --push) kept back: this server does not offer harvested deltas to"
        " nodes (serve --serve-harvested); an agent never signs harvested bytes: it rebuilds"
        " a workload with a [[command]] itself and publishes what its own run compiles; add"
        " the jobs' shapes to the workload"
    )


def _left(facts: StatusFacts, event: EventOut) -> bool:
    """Whether the agent that reported ``event`` has registered another environment since."""
    since = facts.agent_since.get(event.agent_id)
    return since is not None and event.at < since


def _superseded(facts: StatusFacts) -> set[tuple[str, str]]:
    """Pairs whose newest report an agent superseded (a later report on the same workload
    under another digest, or a change of its environment since), and that hold no snapshot
    and no job report (see the module docstring)."""
    newest: dict[tuple[str, str], int] = {}  # (agent id, workload) -> its newest event's id
    for (w, _d), event in facts.latest.items():
        key = (event.agent_id, w)
        newest[key] = max(newest.get(key, event.id), event.id)
    return {
        (w, d)
        for (w, d), event in facts.latest.items()
        if (event.id < newest[(event.agent_id, w)] or _left(facts, event))
        and (w, d) not in facts.verified
        and (w, d) not in facts.unverified
        and (w, d) not in facts.jobs
    }


# -- queries: the facts, read at one time ----------------------------------------------


def status_facts(catalog: Catalog) -> StatusFacts:
    """What ``Fleet.status`` decides each (workload, fingerprint digest)'s status from."""
    with catalog.reading():
        return _status_facts(catalog)


def _status_facts(catalog: Catalog) -> StatusFacts:
    workload_rows = catalog.rows("SELECT name, digest FROM workloads ORDER BY name")
    workloads = tuple(r["name"] for r in workload_rows)
    agent_rows = catalog.rows(
        "SELECT id, name, fingerprint_digest, last_seen_at, registered_at FROM agents"
        " ORDER BY name, id"
    )
    agents = tuple((r["name"], r["fingerprint_digest"]) for r in agent_rows)
    latest = [
        event_of(r)
        for r in catalog.rows(
            "SELECT e.* FROM agent_events e JOIN (SELECT MAX(id) AS id FROM agent_events"
            " GROUP BY workload, fingerprint_digest) m ON e.id = m.id"
        )
    ]
    verified: dict[tuple[str, str], tuple[str, str]] = {}
    unverified: dict[tuple[str, str], tuple[str, str]] = {}
    covers: dict[str, tuple[str, ...]] = {}
    built_for: dict[str, str | None] = {}
    for snap in catalog.rows(  # harvested deltas are never a pair's snapshot
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
        for r in catalog.rows(sql, part):
            stored.add(r["id"])
            covers[r["id"]] = tuple(json.loads(r["devices"] or "[]"))
            built_for[r["id"]] = r["workload_digest"]
    harvested = {
        (r["workload"], r["fingerprint_digest"]): int(r["n"])
        for r in catalog.rows(
            "SELECT workload, fingerprint_digest, COUNT(*) AS n FROM snapshots"
            " WHERE source = 'harvest' AND workload IS NOT NULL"
            " GROUP BY workload, fingerprint_digest"
        )
    }
    vouched = {d for _name, d in agents}
    vouched.update(
        r["fingerprint_digest"]
        for r in catalog.rows("SELECT DISTINCT fingerprint_digest FROM snapshots")
    )
    return StatusFacts(
        vouched=frozenset(vouched),
        workloads=workloads,
        agents=agents,
        latest={(e.workload, e.fingerprint_digest): e for e in latest},
        verified=verified,
        stored=frozenset(stored),
        covers=covers,
        jobs={(j.workload, j.fingerprint_digest): j for j in job_stats(catalog)},
        harvested=harvested,
        unverified=unverified,
        agent_of={r["id"]: (r["name"], r["fingerprint_digest"]) for r in agent_rows},
        agent_seen={r["id"]: r["last_seen_at"] for r in agent_rows},
        agent_since={r["id"]: r["registered_at"] for r in agent_rows},
        workload_digests={r["name"]: r["digest"] for r in workload_rows},
        built_for=built_for,
    )
