"""Agents, their events, and the status matrix (``/v1/agents``, ``/v1/status``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from ._core import (
    AGENT_NAME_PATTERN,
    DIGEST_PATTERN,
    NAME_PATTERN,
    Check,
    Digest,
    EventStatus,
    PairStatus,
)
from .reports import JobStats

# -- agents and status ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AgentRegistration:
    """``POST /v1/agents``."""

    name: Annotated[str, Check(pattern=AGENT_NAME_PATTERN)]
    fingerprint: dict[
        str, Any
    ]  # a cachekeeper.environment.fingerprint.Fingerprint (the route parses it)
    fingerprint_digest: Annotated[str, Check(pattern=DIGEST_PATTERN)] | None = None
    gpus: Annotated[list[dict[str, Any]], Check(max_length=1024)] = field(default_factory=list)
    devices: Annotated[list[str], Check(max_length=1024)] = field(default_factory=list)
    version: Annotated[str, Check(max_length=64)] = ""


@dataclass(frozen=True, kw_only=True)
class AgentInfo:
    """A registered agent (AGENT in docs/api.md)."""

    id: str
    name: str
    fingerprint_digest: str
    fingerprint: dict[str, Any]
    devices: tuple[str, ...]
    gpus: tuple[dict[str, Any], ...]
    version: str
    registered_at: str
    last_seen_at: str


@dataclass(frozen=True, kw_only=True)
class RegisterAnswer(AgentInfo):
    created: bool


@dataclass(frozen=True, kw_only=True)
class AgentList:
    agents: tuple[AgentInfo, ...]


@dataclass(frozen=True, kw_only=True)
class AgentEvent:
    """``POST /v1/agents/{id}/events``: one build outcome, or a build starting."""

    workload: Annotated[str, Check(pattern=NAME_PATTERN)]
    fingerprint_digest: Digest
    status: EventStatus
    detail: Annotated[str, Check(max_length=8000)] = ""
    traceback_tail: Annotated[
        list[Annotated[str, Check(max_length=2000)]], Check(max_length=100)
    ] = field(default_factory=list)
    snapshot_id: Digest | None = None
    seconds: Annotated[float, Check(ge=0)] | None = None


@dataclass(frozen=True, kw_only=True)
class EventOut(AgentEvent):
    """An event as stored (EVENT in docs/api.md)."""

    id: int
    at: str
    agent_id: str


@dataclass(frozen=True, kw_only=True)
class StatusRow:
    """One (workload, fingerprint digest) pair of ``GET /v1/status``."""

    workload: str
    fingerprint_digest: str
    status: PairStatus
    snapshot_id: str | None
    updated_at: str | None
    last_event: EventOut | None
    agents: tuple[str, ...]
    devices: tuple[str, ...] = ()  # what the row's snapshot covers
    uncovered: tuple[str, ...] = ()  # of ?devices=, what it does not cover
    note: str | None = None  # what to do about ``uncovered``
    jobs: JobStats | None = None  # what jobs reported (POST /v1/reports); None: no report
    jobs_note: str | None = None  # "restored, but N jobs compiled anyway", what to do
    harvested: int = 0  # harvested deltas stored for the pair (postjob --push)
    harvest_note: str | None = None  # whether nodes get them, in words
    stale: str | None = None  # why a warm/building state is out of date (server/resources/fleet.py)


@dataclass(frozen=True, kw_only=True)
class StatusAnswer:
    status: tuple[StatusRow, ...]
