"""Health, errors, workloads and GC: the operator routes' shapes."""

from __future__ import annotations

from dataclasses import dataclass

# -- health and errors ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Health:
    """``GET /healthz``."""

    status: str
    version: str


@dataclass(frozen=True, kw_only=True)
class ErrorBody:
    """Every error answer; some codes add fields (``missing``, ``expected``, ``actual``)."""

    error: str
    detail: str


# -- workloads --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WorkloadInfo:
    name: str
    digest: str
    updated_at: str


@dataclass(frozen=True, kw_only=True)
class WorkloadList:
    workloads: tuple[WorkloadInfo, ...]


# -- gc ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GcRequest:
    dry_run: bool = False


@dataclass(frozen=True, kw_only=True)
class GcAnswer:
    """What a GC evicted and freed (would, with ``dry_run``), and what it keeps for now:
    unreferenced blobs used less than the grace period ago, which a GC after
    ``grace_ends_at`` frees unless a snapshot references them again."""

    snapshots_evicted: tuple[str, ...]
    blobs_deleted: int
    bytes_freed: int
    dry_run: bool
    blobs_in_grace: int = 0
    bytes_in_grace: int = 0
    grace_ends_at: str | None = None
    grace_s: float | None = None  # the server's gc_grace_s
