"""What a prewarm proved about a cache dir, kept in the dir for the snapshot made from it.

``cachekeeper prewarm`` writes, after its verify run::

    <cache_dir>/.cachekeeper/prewarm/<workload>.json
      {"workload", "workload_digest", "devices": [...], "stats": {...}, "cpu": {...},
       "key_switches": {...}, "recorded_at"}

and ``snapshot_dir(..., workload=NAME)`` (so ``cachekeeper snapshot`` and ``push``) reads it
to fill the manifest's ``stats`` (verified when ``stats["verify"]["effective"]``),
``workload_digest`` and covered ``devices``, and the fingerprint's ``cpu`` field with the
CPU state the children compiled under (``cachekeeper.environment.cpu``: the workload's
``[process] omp_num_threads``, not the shell's that runs ``snapshot``), and its ``env`` with
the per-key tier's switches in torch's keys the children ran with (``key_switches``: a
dir prewarmed without them is labelled so, whatever the shell that pushes it runs with).
``.cachekeeper/`` never enters a snapshot.
A later prewarm of the same workload on other devices adds its devices to the record;
the stats are those of the latest prewarm. A dir that was never prewarmed by cachekeeper
(someone's own warm cache) has no record: its snapshot is unverified, and says so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from cachekeeper.errors import CachekeeperError
from cachekeeper.restore.marker import STATE_DIR, state_dir

if TYPE_CHECKING:
    from cachekeeper.environment.fingerprint import CpuState

__all__ = [
    "record_prewarm",
    "load_prewarm_record",
    "recorded_cpu",
    "recorded_key_switches",
    "recorded_workloads",
]

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _record_name(workload: str) -> str:
    return f"prewarm/{_SAFE.sub('_', workload)}.json"


def _read(cache_dir: Path, rel: str) -> Any:
    """The JSON of ``.cachekeeper/<rel>`` (links never followed), or None."""
    try:
        with state_dir(cache_dir, create=False) as state:
            return json.loads(state.read_file(rel) or b"")
    except (OSError, ValueError, CachekeeperError):
        return None


def load_prewarm_record(cache_dir: Path, workload: str) -> dict[str, Any] | None:
    """The record a prewarm of ``workload`` left in ``cache_dir``, or None."""
    record = _read(cache_dir, _record_name(workload))
    if not isinstance(record, dict) or record.get("workload") != workload:
        return None
    return record


def recorded_cpu(record: Mapping[str, Any] | None) -> CpuState | None:
    """The CPU state a record's prewarm compiled under (the fingerprint's ``cpu`` field of
    the snapshot made from it), or None: no record, or one from before the field."""
    found = None if record is None else record.get("cpu")
    return cast("CpuState", found) if isinstance(found, dict) else None


def recorded_key_switches(record: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The tier's key-relevant switches a record's prewarm ran with, or None: no record,
    or one from before the field."""
    found = None if record is None else record.get("key_switches")
    if not isinstance(found, dict):
        return None
    return {str(k): str(v) for k, v in found.items()}


def recorded_workloads(cache_dir: Path) -> list[str]:
    """The workloads a prewarm recorded in ``cache_dir``, sorted (none: an empty list)."""
    names: set[str] = set()
    try:
        with state_dir(cache_dir, create=False) as state:
            found = sorted(n for n in state.names("prewarm") if n.endswith(".json"))
    except (OSError, CachekeeperError):
        return []
    for name in found:
        record = _read(cache_dir, f"prewarm/{name}")
        if isinstance(record, dict) and isinstance(record.get("workload"), str):
            names.add(record["workload"])
    return sorted(names)


def record_prewarm(
    cache_dir: Path,
    *,
    workload: str,
    workload_digest: str,
    devices: list[str],
    stats: dict[str, Any],
    cpu: CpuState | None = None,
    key_switches: Mapping[str, str] | None = None,
) -> Path:
    """Write (atomically) what a prewarm proved; devices accumulate across prewarms.
    ``key_switches``: the per-key tier's switches in torch's keys that its children ran
    with (``remote_tier.key_switches``), which the snapshot's fingerprint then records."""
    rel = _record_name(workload)
    previous = load_prewarm_record(cache_dir, workload)
    if previous and previous.get("workload_digest") == workload_digest:
        devices = sorted(set(devices) | set(previous.get("devices") or []))
    record = {
        "workload": workload,
        "workload_digest": workload_digest,
        "devices": sorted(devices),
        "stats": stats,
        "cpu": cpu,
        "key_switches": None if key_switches is None else dict(key_switches),
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    with state_dir(cache_dir, create=True) as state:  # a planted link is refused, not followed
        state.write_file(rel, json.dumps(record, indent=2, sort_keys=True).encode())
    return Path(cache_dir) / STATE_DIR / rel
