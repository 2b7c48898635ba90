"""The fleet's status: one row per (workload, fingerprint digest), decided from the catalog.

``GET /v1/status`` answers one row per (workload, fingerprint digest) the server knows of:
every registered workload for every registered agent's fingerprint, plus any pair an
event or a verified snapshot names. Its ``status`` is decided by the newest fact about the
pair, an agent's report or the publication of a verified snapshot with that exact
fingerprint digest:

- ``building``: the newest fact is an agent's ``building`` report (see ``last_event.at``
  and the agent's ``last_seen_at`` to tell a build in progress from an agent that died);
- ``warm``: the newest fact is a verified snapshot, or a ``built``/``skipped`` report whose
  snapshot is still stored;
- ``broken``: the newest report is ``cold_compile_broken`` (the workload raised during a
  cold compile: exactly what a warm cache would hide);
- ``failed``: the newest report is ``failed`` (crash, timeout, verify not effective,
  push failed, abandoned on shutdown);
- ``missing``: nothing was built for the pair (or the snapshot a report named is gone).

Each row also says which devices its warm snapshot covers (``devices``); given the
training nodes' devices, the ones it does not cover (``uncovered``) and a ``note``.

``jobs`` adds up what training jobs reported for the pair (``POST /v1/reports``; a pair a
report names is a row when its workload is registered and its fingerprint digest is one
an agent registered or a stored snapshot records, since anyone with a read token can
report any digest): restores, cold starts by reason, jobs that compiled anyway. ``jobs_note`` says when restored jobs compiled anyway: the
workload file does not match training.

The facts are read by ``Catalog.status_facts``; this module only decides.
"""

from __future__ import annotations

from cachekeeper.devices import coverage_advice
from cachekeeper.wire import EventOut, StatusRow

from .records import StatusFacts

__all__ = ["fleet_status"]


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
    return ("broken" if event.status == "cold_compile_broken" else "failed"), None, event.at


def fleet_status(
    facts: StatusFacts,
    *,
    workload: str | None = None,
    fingerprint_digest: str | None = None,
    devices: list[str] | None = None,
) -> list[StatusRow]:
    """The status rows (see the module docstring), sorted by workload then digest.

    ``devices``: the devices training nodes use; rows then say what they leave uncovered.
    """
    names_by_digest: dict[str, list[str]] = {}
    for name, digest in facts.agents:
        names_by_digest.setdefault(digest, []).append(name)
    pairs = {(w, d) for w in facts.workloads for d in names_by_digest}
    pairs |= set(facts.latest)
    pairs |= {key for key in facts.verified if key[0] in facts.workloads}
    # Job reports need only a read token: they add a row only for an environment an agent
    # or a stored snapshot vouches for (random fingerprints must not flood the status).
    pairs |= {key for key in facts.jobs if key[0] in facts.workloads and key[1] in facts.vouched}
    rows = []
    for w, d in sorted(pairs):
        if (workload is not None and w != workload) or (
            fingerprint_digest is not None and d != fingerprint_digest
        ):
            continue
        event = facts.latest.get((w, d))
        status, snapshot_id, updated_at = _decide(event, facts.verified.get((w, d)), facts.stored)
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
                agents=tuple(names_by_digest.get(d, [])),
                devices=tuple(covered),
                uncovered=tuple(uncovered),
                note=note,
                jobs=facts.jobs.get((w, d)),
                jobs_note=facts.jobs[(w, d)].mismatch_note if (w, d) in facts.jobs else None,
            )
        )
    return rows
