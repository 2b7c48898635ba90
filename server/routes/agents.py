"""``/v1/agents`` and ``/v1/status``: builder agents, what they report, and the fleet's state.

An agent is one per name: its id is derived from its name (``catalog.agent_id_for``), so
registering again is idempotent (it refreshes ``last_seen_at``, devices, GPUs and version),
and an agent whose torch, Triton, CUDA wheels or driver changed keeps its id with its new
environment (``registered_at`` then says when that environment began; what it reported
under the one before is out of date, ``server/resources/fleet.py``). Reports go to ``agent_events``, one
row per report; nothing is ever updated in place. How ``/v1/status`` decides each row's
status (and the devices a row's snapshot covers or leaves uncovered, given
``?devices=cuda:0-7``, and what training jobs reported for the pair: ``jobs``,
``jobs_note``) is written in ``server/resources/fleet.py``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from cachekeeper.environment.devices import requested_devices
from cachekeeper.environment.fingerprint import digest_of, json_digest, parse
from cachekeeper.errors import (
    AgentNotFound,
    CachekeeperError,
    InsufficientStorage,
    InvalidManifest,
    InvalidRequest,
)
from cachekeeper.server.auth import ReadScope, WriteScope
from cachekeeper.server.deps import ServicesDep
from cachekeeper.server.responses import error_responses
from cachekeeper.wire import (
    DIGEST_PATTERN,
    AgentEvent,
    AgentInfo,
    AgentList,
    AgentRegistration,
    EventOut,
    RegisterAnswer,
    StatusAnswer,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["agents"])

AgentId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="the agent's id")]


@router.post(
    "/agents",
    response_model=RegisterAnswer,
    responses=error_responses(InvalidManifest, InsufficientStorage),
)
def register_agent(body: AgentRegistration, services: ServicesDep, _: WriteScope) -> dict[str, Any]:
    """Register (or refresh) the agent of a name with its environment; idempotent."""
    fingerprint = parse(body.fingerprint)  # a bad field is a 422 that names it
    try:
        digest = digest_of(fingerprint)
        # an agent before issue 31 sends the digest of the whole JSON (fingerprint.py)
        sent_by_older = json_digest(fingerprint)
    except (TypeError, ValueError) as exc:
        raise InvalidManifest(f"fingerprint is not canonical JSON: {exc}") from exc
    if body.fingerprint_digest not in (None, digest, sent_by_older):
        raise InvalidManifest(
            f"fingerprint_digest {body.fingerprint_digest[:12]} is not the digest of the"
            f" fingerprint sent ({digest[:12]})"
        )
    agent, created = services.agents.register(
        name=body.name,
        fingerprint=fingerprint,
        fingerprint_digest=digest,
        devices=list(body.devices),
        gpus=list(body.gpus),
        version=body.version,
    )
    return {**asdict(agent), "created": created}


@router.post(
    "/agents/{agent_id}/heartbeat",
    response_model=AgentInfo,
    responses=error_responses(AgentNotFound),
)
def heartbeat(agent_id: AgentId, services: ServicesDep, _: WriteScope) -> dict[str, Any]:
    """Record that the agent is alive (``last_seen_at``)."""
    return asdict(services.agents.heartbeat(agent_id))


@router.get("/agents", response_model=AgentList)
def list_agents(services: ServicesDep, _: ReadScope) -> dict[str, Any]:
    """Every registered agent, the most recently seen first."""
    return {"agents": [asdict(a) for a in services.agents.list_all()]}


@router.post(
    "/agents/{agent_id}/events",
    status_code=201,
    response_model=EventOut,
    responses=error_responses(AgentNotFound, InsufficientStorage),
)
def report_event(
    agent_id: AgentId, body: AgentEvent, services: ServicesDep, _: WriteScope
) -> dict[str, Any]:
    """Record one build outcome (or a build starting); also counts as a heartbeat."""
    event = services.agents.report_event(
        agent_id,
        workload=body.workload,
        fingerprint_digest=body.fingerprint_digest,
        status=body.status,
        detail=body.detail,
        traceback_tail=list(body.traceback_tail),
        snapshot_id=body.snapshot_id,
        seconds=body.seconds,
    )
    return asdict(event)


# -- status ---------------------------------------------------------------------------------


@router.get("/status", response_model=StatusAnswer)
def status(
    services: ServicesDep,
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
    rows = services.fleet.status(
        workload=workload, fingerprint_digest=fingerprint_digest, devices=wanted
    )
    return {"status": [asdict(r) for r in rows]}
