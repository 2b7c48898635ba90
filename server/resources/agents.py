"""The agents resource (``/v1/agents``): registrations, heartbeats and build events; its
service ``Agents`` and its queries (the ``agents`` and ``agent_events`` tables).

An agent is one per name (``agent_id_for``, ``server/catalog/schema.py``): a changed
environment updates it. Every registration and event is checked against its table's
budget in the same transaction as its row (``server/budgets.py``), after a retention pass
when one is due. What the fleet status decides from these rows is
``server/resources/fleet.py``'s.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from cachekeeper.environment.fingerprint import Fingerprint
from cachekeeper.errors import AgentNotFound
from cachekeeper.server.budgets import Budgets, event_bytes
from cachekeeper.server.catalog import Catalog, Transaction, agent_id_for
from cachekeeper.wire import AgentInfo, EventOut, EventStatus, utc_now

__all__ = [
    "Agents",
    "add_agent_event",
    "agent",
    "agent_seen",
    "event_of",
    "list_agents",
    "register_agent",
]


class Agents:
    """The agents as the routes see them."""

    def __init__(self, *, catalog: Catalog, budgets: Budgets) -> None:
        self.catalog = catalog
        self.budgets = budgets

    def register(self, **registration: Any) -> tuple[AgentInfo, bool]:
        """(agent, created); see ``register_agent`` for the keywords."""
        self.budgets.retain(self.catalog)
        with self.catalog.writing() as tx:
            self.budgets.admit_agent(
                tx,
                agent_id=agent_id_for(registration["name"]),
                fields={k: registration[k] for k in ("fingerprint", "gpus", "devices")},
                now=datetime.now(UTC),
            )
            agent_id, created = register_agent(tx, **registration)
        return self.get(agent_id), created

    def get(self, agent_id: str) -> AgentInfo:
        found = agent(self.catalog, agent_id)
        if found is None:
            raise AgentNotFound(f"no agent {agent_id!r} is registered (register it first)")
        return found

    def list_all(self) -> list[AgentInfo]:
        return list_agents(self.catalog)

    def heartbeat(self, agent_id: str) -> AgentInfo:
        with self.catalog.writing() as tx:
            agent_seen(tx, agent_id)
        return self.get(agent_id)

    def report_event(self, agent_id: str, **report: Any) -> EventOut:
        """Record an agent's report; see ``add_agent_event`` for the keywords."""
        self.budgets.retain(self.catalog)
        size = event_bytes(
            workload=report["workload"],
            detail=report["detail"],
            traceback_tail=report["traceback_tail"],
        )
        with self.catalog.writing() as tx:
            if tx.one("SELECT 1 FROM agents WHERE id = ?", [agent_id]) is None:
                raise AgentNotFound(f"no agent {agent_id!r} is registered (register it first)")
            self.budgets.admit_agent_event(tx, size_bytes=size)
            event = add_agent_event(tx, agent_id, size_bytes=size, **report)
        if event is None:
            raise AgentNotFound(f"no agent {agent_id!r} is registered (register it first)")
        return event


# -- queries: the agents and their events ----------------------------------------------


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


def event_of(row: dict[str, Any]) -> EventOut:
    """An ``agent_events`` row as the API answers it."""
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


def register_agent(
    tx: Transaction,
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
    created = tx.one("SELECT 1 FROM agents WHERE id = ?", [agent_id]) is None
    tx.db.execute(
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


def agent_seen(tx: Transaction, agent_id: str, *, at: str | None = None) -> bool:
    """Set the agent's ``last_seen_at``; False when no such agent."""
    sql = "UPDATE agents SET last_seen_at = ? WHERE id = ?"
    return tx.db.execute(sql, [at or utc_now(), agent_id]).rowcount > 0


def add_agent_event(
    tx: Transaction,
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
    if not agent_seen(tx, agent_id, at=now):
        return None
    cursor = tx.db.execute(
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


def agent(catalog: Catalog, agent_id: str) -> AgentInfo | None:
    found = catalog.rows("SELECT * FROM agents WHERE id = ?", [agent_id])
    return _agent(found[0]) if found else None


def list_agents(catalog: Catalog) -> list[AgentInfo]:
    rows = catalog.rows("SELECT * FROM agents ORDER BY last_seen_at DESC, id")
    return [_agent(r) for r in rows]
