"""server/resources/fleet.py: each status row decided from the catalog's facts (no server needed).

The rows the JSON route, ``cachekeeper status`` and the status page show all come from
``fleet_status``; these tests build ``StatusFacts`` by hand for the decisions that need
a clock or several agents.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cachekeeper.server.resources.fleet import STALE_AFTER_S, StatusFacts, fleet_status
from cachekeeper.wire import EventOut

A, B = "a" * 64, "b" * 64  # two fingerprint digests
SNAP = "5" * 64
AT = "2026-01-01T12:00:00.000000+00:00"


def event(status: str, *, digest: str = A, agent: str = "agent-1", snapshot: str | None = None):
    return EventOut(
        id=1,
        at=AT,
        agent_id=agent,
        workload="w",
        fingerprint_digest=digest,
        status=status,  # type: ignore[arg-type]
        snapshot_id=snapshot,
    )


def facts(**fields) -> StatusFacts:
    base = dict(
        workloads=("w",),
        agents=(("builder", A),),
        latest={},
        verified={},
        stored=frozenset(),
        covers={},
        jobs={},
        agent_of={"agent-1": ("builder", A)},
        agent_seen={"agent-1": AT},
        workload_digests={"w": "d" * 64},
    )
    return StatusFacts(**{**base, **fields})  # type: ignore[arg-type]


def test_a_build_whose_agent_went_silent_is_stale() -> None:
    """The one state that needs a clock: ``building`` with its agent unseen for too long."""
    building = facts(latest={("w", A): event("building")})
    seen = datetime.fromisoformat(AT)

    def row(minutes_later: int):
        (only,) = fleet_status(building, now=seen + timedelta(minutes=minutes_later))
        return only

    assert row(1).status == "building" and row(1).stale is None
    late = row(STALE_AFTER_S // 60 + 1)
    assert late.status == "building" and late.stale and "not been seen since" in late.stale


def test_a_snapshot_is_stale_only_when_the_workload_digest_changed() -> None:
    """Re-registering an identical TOML keeps its cells warm: digests, not times."""
    built_from = "d" * 64
    warm = dict(verified={("w", A): (SNAP, AT)}, covers={SNAP: ("cpu",)})
    now = datetime(2030, 1, 1, tzinfo=UTC)
    same = facts(**warm, built_for={SNAP: built_from}, workload_digests={"w": built_from})
    (row,) = fleet_status(same, now=now)
    assert row.status == "warm" and row.stale is None
    changed = facts(**warm, built_for={SNAP: built_from}, workload_digests={"w": "e" * 64})
    (row,) = fleet_status(changed, now=now)
    assert row.status == "warm" and row.stale and "workload file changed" in row.stale
    unknown = facts(**warm, built_for={SNAP: None})  # a push of a dir nobody prewarmed
    assert fleet_status(unknown, now=now)[0].stale is None


def test_an_agent_building_under_its_childrens_fingerprint_has_one_row() -> None:
    """[process] omp_num_threads: the agent (digest A) builds and reports under B; the
    workload's row is B's, with the agent named, and no "missing" row under A."""
    built = facts(
        latest={("w", B): event("built", digest=B, snapshot=SNAP)},
        stored=frozenset({SNAP}),
        covers={SNAP: ("cpu",)},
    )
    rows = fleet_status(built)
    assert [(r.fingerprint_digest, r.status, r.agents) for r in rows] == [(B, "warm", ("builder",))]
    # the agent's own digest still has its row when it has history there
    both = facts(latest={("w", B): event("built", digest=B, snapshot=SNAP), ("w", A): event("failed")},
                 stored=frozenset({SNAP}))  # fmt: skip
    assert [(r.fingerprint_digest, r.status) for r in fleet_status(both)] == [
        (A, "failed"),
        (B, "warm"),
    ]


def test_an_agents_later_report_under_another_digest_supersedes_its_earlier_one() -> None:
    """A command workload: the agent refused it under its children's digest (A), then,
    allowed, built it under the digest of what the command's ranks compiled with (B). One
    row, warm; the refused one is gone. A report of another agent is never superseded."""
    refused = EventOut(**{**event("refused", digest=A).__dict__, "id": 1})
    built = EventOut(**{**event("built", digest=B, snapshot=SNAP).__dict__, "id": 2})
    both = facts(
        latest={("w", A): refused, ("w", B): built},
        stored=frozenset({SNAP}),
        verified={("w", B): (SNAP, AT)},
    )
    rows = fleet_status(both)
    assert [(r.fingerprint_digest, r.status) for r in rows] == [(B, "warm")]
    other = EventOut(**{**refused.__dict__, "agent_id": "agent-2"})
    kept = facts(
        latest={("w", A): other, ("w", B): built},
        stored=frozenset({SNAP}),
        verified={("w", B): (SNAP, AT)},
        agent_of={"agent-1": ("builder", A), "agent-2": ("builder-2", A)},
    )
    assert {(r.fingerprint_digest, r.status) for r in fleet_status(kept)} == {
        (A, "refused"),
        (B, "warm"),
    }
