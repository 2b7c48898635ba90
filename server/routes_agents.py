"""``/v1/agents`` and ``/v1/status``: builder agents, what they report, and the fleet's state.

An agent registers once per environment: its id is derived from its name and its
fingerprint digest (``sha256(name + "\\n" + digest)[:16]``), so registering again is
idempotent (it refreshes ``last_seen_at``, devices, GPUs and version) and an agent whose
torch, Triton, CUDA wheels or driver changed registers as a new id. Reports go to
``agent_events``, one row per report; nothing is ever updated in place.

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

Each row also says which devices its warm snapshot covers (``devices``). The device index
is in Inductor's key, so a snapshot serves only jobs whose ranks compile on those indices.
``?devices=cuda:0-7`` asks about the training nodes' devices: each row then lists the
ones its snapshot does not cover (``uncovered``) and a one-line ``note`` on what to do
(a builder with fewer GPUs than the nodes cannot build the higher indices).

``jobs`` adds up what training jobs reported for the pair (``POST /v1/reports``; a pair a
report names is a row when its workload is registered): restores, cold starts by reason,
jobs that compiled anyway. ``jobs_note`` says when restored jobs compiled anyway: the
workload file does not match training.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from cachekeeper.devices import coverage_advice, requested_devices
from cachekeeper.errors import AgentNotFound, CachekeeperError, InvalidManifest, InvalidRequest
from cachekeeper.fingerprint import digest_of
from cachekeeper.wire import (
    DIGEST_PATTERN,
    AgentEvent,
    AgentInfo,
    AgentList,
    AgentRegistration,
    EventOut,
    RegisterAnswer,
    StatusAnswer,
    to_dict,
)

from .auth import ReadScope, WriteScope
from .catalog import utc_now
from .deps import StorageDep
from .responses import error_responses
from .storage import Storage

__all__ = ["router", "agent_id_for", "fleet_status"]

router = APIRouter(prefix="/v1", tags=["agents"])

AgentId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="the agent's id")]


def agent_id_for(name: str, fingerprint_digest: str) -> str:
    """The id an agent of ``name`` gets for an environment (stable across registrations)."""
    return hashlib.sha256(f"{name}\n{fingerprint_digest}".encode()).hexdigest()[:16]


# -- agents ---------------------------------------------------------------------------------


def _agent_out(row: dict[str, Any]) -> dict[str, Any]:
    info = json.loads(row["info"] or "{}")
    return {
        "id": row["id"],
        "name": row["name"],
        "fingerprint_digest": row["fingerprint_digest"],
        "fingerprint": json.loads(row["fingerprint"]),
        "devices": json.loads(row["devices"] or "[]"),
        "gpus": info.get("gpus") or [],
        "version": info.get("version") or "",
        "registered_at": row["registered_at"],
        "last_seen_at": row["last_seen_at"],
    }


def _agent_row(storage: Storage, agent_id: str) -> dict[str, Any]:
    found = storage.catalog.rows("SELECT * FROM agents WHERE id = ?", [agent_id])
    if not found:
        raise AgentNotFound(f"no agent {agent_id!r} is registered (register it first)")
    return found[0]


@router.post("/agents", response_model=RegisterAnswer, responses=error_responses(InvalidManifest))
def register_agent(body: AgentRegistration, storage: StorageDep, _: WriteScope) -> dict[str, Any]:
    """Register (or refresh) an agent for its environment; idempotent per name + digest."""
    try:
        digest = digest_of(body.fingerprint)
    except (TypeError, ValueError) as exc:
        raise InvalidManifest(f"fingerprint is not canonical JSON: {exc}") from exc
    if body.fingerprint_digest is not None and body.fingerprint_digest != digest:
        raise InvalidManifest(
            f"fingerprint_digest {body.fingerprint_digest[:12]} is not the digest of the"
            f" fingerprint sent ({digest[:12]})"
        )
    agent_id = agent_id_for(body.name, digest)
    now = utc_now()
    info = json.dumps({"gpus": body.gpus, "version": body.version}, sort_keys=True)
    with storage.catalog.writing() as db:
        created = db.execute("SELECT 1 FROM agents WHERE id = ?", [agent_id]).fetchone() is None
        db.execute(
            "INSERT INTO agents (id, name, fingerprint_digest, fingerprint, devices,"
            " registered_at, last_seen_at, info) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(id) DO UPDATE SET devices = excluded.devices,"
            " last_seen_at = excluded.last_seen_at, info = excluded.info",
            [
                agent_id,
                body.name,
                digest,
                json.dumps(body.fingerprint, sort_keys=True),
                json.dumps(body.devices),
                now,
                now,
                info,
            ],
        )
    return {**_agent_out(_agent_row(storage, agent_id)), "created": created}


@router.post(
    "/agents/{agent_id}/heartbeat",
    response_model=AgentInfo,
    responses=error_responses(AgentNotFound),
)
def heartbeat(agent_id: AgentId, storage: StorageDep, _: WriteScope) -> dict[str, Any]:
    """Record that the agent is alive (``last_seen_at``)."""
    with storage.catalog.writing() as db:
        db.execute("UPDATE agents SET last_seen_at = ? WHERE id = ?", [utc_now(), agent_id])
    return _agent_out(_agent_row(storage, agent_id))


@router.get("/agents", response_model=AgentList)
def list_agents(storage: StorageDep, _: ReadScope) -> dict[str, Any]:
    """Every registered agent, the most recently seen first."""
    rows = storage.catalog.rows("SELECT * FROM agents ORDER BY last_seen_at DESC, id")
    return {"agents": [_agent_out(r) for r in rows]}


@router.post(
    "/agents/{agent_id}/events",
    status_code=201,
    response_model=EventOut,
    responses=error_responses(AgentNotFound),
)
def report_event(
    agent_id: AgentId, body: AgentEvent, storage: StorageDep, _: WriteScope
) -> dict[str, Any]:
    """Record one build outcome (or a build starting); also counts as a heartbeat."""
    _agent_row(storage, agent_id)
    now = utc_now()
    with storage.catalog.writing() as db:
        cursor = db.execute(
            "INSERT INTO agent_events (at, agent_id, workload, fingerprint_digest, status,"
            " detail, traceback_tail, snapshot_id, seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                now,
                agent_id,
                body.workload,
                body.fingerprint_digest,
                body.status,
                body.detail,
                json.dumps(body.traceback_tail),
                body.snapshot_id,
                body.seconds,
            ],
        )
        db.execute("UPDATE agents SET last_seen_at = ? WHERE id = ?", [now, agent_id])
        event_id = cursor.lastrowid
    return {**to_dict(body), "id": event_id, "at": now, "agent_id": agent_id}


# -- status ---------------------------------------------------------------------------------


def _event_out(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "at": row["at"],
        "agent_id": row["agent_id"],
        "workload": row["workload"],
        "fingerprint_digest": row["fingerprint_digest"],
        "status": row["status"],
        "detail": row["detail"] or "",
        "traceback_tail": json.loads(row["traceback_tail"] or "[]"),
        "snapshot_id": row["snapshot_id"],
        "seconds": row["seconds"],
    }


def _decide(
    event: dict[str, Any] | None, verified: dict[str, Any] | None, stored: set[str]
) -> tuple[str, str | None, str | None]:
    """(status, warm snapshot id, updated_at) from the newest event and verified snapshot."""
    snap_at = verified["created_at"] if verified else None
    if event is None or (snap_at is not None and snap_at > event["at"]):
        if verified is None:
            return "missing", None, None
        return "warm", verified["id"], snap_at
    at = event["at"]
    status = event["status"]
    if status == "building":
        return "building", None, at
    if status in ("built", "skipped"):
        if event["snapshot_id"] in stored:
            return "warm", event["snapshot_id"], at
        if verified is not None:
            return "warm", verified["id"], at
        return "missing", None, at
    return ("broken" if status == "cold_compile_broken" else "failed"), None, at


def fleet_status(
    storage: Storage,
    *,
    workload: str | None = None,
    fingerprint_digest: str | None = None,
    devices: list[str] | None = None,
) -> list[dict[str, Any]]:
    """The status rows (see the module docstring), sorted by workload then digest.

    ``devices``: the devices training nodes use; rows then say what they leave uncovered.
    """
    catalog = storage.catalog
    registered = [r["name"] for r in catalog.list_workloads()]
    agents = catalog.rows("SELECT id, name, fingerprint_digest FROM agents ORDER BY name")
    names_by_digest: dict[str, list[str]] = {}
    for agent in agents:
        names_by_digest.setdefault(agent["fingerprint_digest"], []).append(agent["name"])
    latest = catalog.rows(
        "SELECT e.* FROM agent_events e JOIN (SELECT MAX(id) AS id FROM agent_events"
        " GROUP BY workload, fingerprint_digest) m ON e.id = m.id"
    )
    events = {(e["workload"], e["fingerprint_digest"]): e for e in latest}
    verified: dict[tuple[str, str], dict[str, Any]] = {}
    for snap in catalog.rows(
        "SELECT id, workload, fingerprint_digest, created_at, devices FROM snapshots"
        " WHERE verified = 1 AND workload IS NOT NULL ORDER BY created_at"
    ):
        verified[(snap["workload"], snap["fingerprint_digest"])] = snap  # newest wins
    stored = {e["snapshot_id"] for e in latest if e["snapshot_id"]}
    covers = {snap["id"]: snap["devices"] for snap in verified.values()}
    if stored:
        marks = ",".join("?" * len(stored))
        found = catalog.rows(
            f"SELECT id, devices FROM snapshots WHERE id IN ({marks})", sorted(stored)
        )
        stored = {r["id"] for r in found}
        covers.update({r["id"]: r["devices"] for r in found})
    jobs = {(j.workload, j.fingerprint_digest): j for j in catalog.job_stats(workload=workload)}
    pairs = {(w, d) for w in registered for d in names_by_digest}
    pairs |= set(events)
    pairs |= {key for key in verified if key[0] in registered}
    pairs |= {key for key in jobs if key[0] in registered}
    rows = []
    for w, d in sorted(pairs):
        if (workload is not None and w != workload) or (
            fingerprint_digest is not None and d != fingerprint_digest
        ):
            continue
        event = events.get((w, d))
        status, snapshot_id, updated_at = _decide(event, verified.get((w, d)), stored)
        covered = json.loads(covers.get(snapshot_id or "") or "[]")
        uncovered = [x for x in devices or [] if x not in covered] if snapshot_id else []
        rows.append(
            {
                "workload": w,
                "fingerprint_digest": d,
                "status": status,
                "snapshot_id": snapshot_id,
                "updated_at": updated_at,
                "last_event": _event_out(event) if event else None,
                "agents": names_by_digest.get(d, []),
                "devices": covered,
                "uncovered": uncovered,
                "note": (
                    coverage_advice(covered=covered, wanted=devices, who="a node")
                    if uncovered
                    else None
                ),
                "jobs": to_dict(jobs[(w, d)]) if (w, d) in jobs else None,
                "jobs_note": jobs[(w, d)].mismatch_note if (w, d) in jobs else None,
            }
        )
    return rows


@router.get("/status", response_model=StatusAnswer)
def status(
    storage: StorageDep,
    _: ReadScope,
    workload: Annotated[str | None, Query()] = None,
    fingerprint_digest: Annotated[str | None, Query(pattern=DIGEST_PATTERN)] = None,
    devices: Annotated[
        str | None,
        Query(max_length=4096, description="the training nodes' devices, e.g. cuda:0-7"),
    ] = None,
) -> dict[str, Any]:
    """warm / building / broken / failed / missing per (workload, fingerprint digest)."""
    try:
        wanted = requested_devices(devices) if devices else None
    except CachekeeperError as exc:
        raise InvalidRequest(exc.detail) from exc
    rows = fleet_status(
        storage, workload=workload, fingerprint_digest=fingerprint_digest, devices=wanted
    )
    return {"status": rows}
