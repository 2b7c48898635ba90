"""The catalog's typed results that are not HTTP shapes: what ``server.catalog`` answers
instead of row dicts. Where a result is what the API answers (a snapshot's summary, an
agent, an event, a workload), the catalog returns ``cachekeeper.wire``'s dataclass itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachekeeper.environment.fingerprint import Fingerprint
from cachekeeper.wire import EventOut, JobStats, Summary

__all__ = ["BlobInfo", "BlobUsage", "Candidate", "Counts", "StatusFacts"]


@dataclass(frozen=True)
class Candidate:
    """A snapshot as resolve compares it: its summary and its full fingerprint."""

    summary: Summary
    fingerprint: Fingerprint
    # The order of publication (SQLite's rowid): newer is larger. Resolve ranks by it, not
    # by ``created_at``, which a server clock that jumped back would turn around.
    seq: int = 0
    built_by: str | None = None  # manifest.built_by of its stats (a cpu mismatch's advice)


@dataclass(frozen=True)
class BlobInfo:
    digest: str
    size_bytes: int  # uncompressed
    stored_bytes: int  # as stored (zstd)
    created_at: str
    last_access_at: str


@dataclass(frozen=True)
class BlobUsage:
    """What a GC plan needs of one blob row."""

    digest: str
    stored_bytes: int
    last_access_at: str
    refs: int  # snapshots referencing it


@dataclass(frozen=True)
class Counts:
    snapshots: int
    blobs: int
    stored_bytes: int


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
