"""What a round of the agent did: one outcome per workload, and the round's report
(``agent --json`` prints them; the server hears each outcome as an event)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cachekeeper import wire

__all__ = ["OutcomeStatus", "RoundReport", "WorkloadOutcome"]

OutcomeStatus = Literal["built", "skipped", "cold_compile_broken", "failed", "refused"]


@dataclass(frozen=True)
class WorkloadOutcome:
    """What one round did for one workload, and whether the server heard about it."""

    workload: str
    status: OutcomeStatus
    fingerprint_digest: str
    prewarm_ran: bool
    seconds: float
    snapshot_id: str | None = None
    detail: str = ""
    traceback_tail: tuple[str, ...] = ()
    reported: bool = False
    abandoned: bool = False
    prewarm: dict[str, Any] | None = None  # PrewarmReport.to_dict() when a prewarm ran

    def to_dict(self) -> dict[str, Any]:
        return wire.to_dict(self)


@dataclass(frozen=True)
class RoundReport:
    """One round: the environment it ran for and each workload's outcome."""

    agent_id: str
    name: str
    fingerprint_digest: str
    fingerprint_changed: bool  # the digest differs from the previous round's
    devices: tuple[str, ...]
    started_at: str
    seconds: float
    outcomes: tuple[WorkloadOutcome, ...]
    stopped: bool  # a stop request ended the round early

    @property
    def prewarms_run(self) -> int:
        return sum(o.prewarm_ran for o in self.outcomes)

    @property
    def all_reported(self) -> bool:
        """Every outcome reached the server (the ``--once`` success condition)."""
        return all(o.reported for o in self.outcomes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "agent_id": self.agent_id,
            "name": self.name,
            "fingerprint_digest": self.fingerprint_digest,
            "fingerprint_changed": self.fingerprint_changed,
            "devices": list(self.devices),
            "started_at": self.started_at,
            "seconds": self.seconds,
            "stopped": self.stopped,
            "prewarms_run": self.prewarms_run,
            "all_reported": self.all_reported,
            "outcomes": [o.to_dict() for o in self.outcomes],
        }
