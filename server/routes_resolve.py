"""``POST /v1/resolve``: the best snapshot for a node, or a miss with the nearest misses.

Ranking among compatible snapshots: verified before unverified, exact (same driver)
before driver-compatible, newest first. Near misses are the incompatible snapshots of the
workload with the fewest mismatching fields (newest first among equals), each with its
field-by-field mismatches so the node can say why it missed. A miss is a value (200 with
``"snapshot": null``), never an error; its ``reason`` says which miss it is: no snapshot
matches, the workload has no snapshot yet, or no workload of that name is registered.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from cachekeeper.errors import InvalidManifest
from cachekeeper.fingerprint import compare
from cachekeeper.wire import ResolveAnswer, ResolveRequest

from .auth import ReadScope
from .catalog import summary_of
from .deps import StorageDep, metrics_of
from .responses import error_responses
from .storage import Storage

__all__ = ["router", "resolve"]

router = APIRouter(prefix="/v1", tags=["resolve"])
NEAR_MISSES = 3


def resolve(storage: Storage, body: ResolveRequest) -> dict[str, Any]:
    """The resolve answer for ``body`` (see the module docstring)."""
    hits: list[tuple[tuple[int, int, str], dict[str, Any]]] = []
    misses: list[tuple[tuple[int, str], dict[str, Any], list[dict[str, Any]]]] = []
    parsed: dict[str, dict[str, Any]] = {}
    candidates = storage.catalog.candidates(body.workload)
    for row in candidates:
        fp = parsed.get(row["fingerprint_digest"])
        if fp is None:
            fp = parsed[row["fingerprint_digest"]] = json.loads(row["fingerprint"])
        devices = json.loads(row["devices"] or "[]") or None
        mismatches = compare(
            body.fingerprint,
            fp,
            driver_policy=body.driver_policy,
            devices=devices,
            node_devices=body.devices,
        )
        summary = summary_of(row)
        if not mismatches:
            exact = body.fingerprint.get("driver") == fp.get("driver")
            hits.append(((int(summary["verified"]), int(exact), row["created_at"]), summary))
        else:
            misses.append(
                ((len(mismatches), row["created_at"]), summary, [m.to_dict() for m in mismatches])
            )
    near = sorted(misses, key=lambda m: (m[0][0], _neg(m[0][1])))[:NEAR_MISSES]
    near_out = [{"snapshot": s, "mismatches": mm} for _k, s, mm in near]
    if not hits:
        return {
            "snapshot": None,
            "verified": False,
            "exact": False,
            "near_misses": near_out,
            "reason": _miss_reason(storage, body.workload, has_snapshots=bool(candidates)),
        }
    (verified, exact, _created), best = max(hits, key=lambda h: h[0])
    storage.catalog.touch_snapshot(best["id"])
    deltas = (
        storage.catalog.harvested_deltas(best["id"], fingerprint_digest=best["fingerprint_digest"])
        if storage.settings.serve_harvested
        else []
    )
    return {
        "snapshot": best,
        "verified": bool(verified),
        "exact": bool(exact),
        "near_misses": near_out,
        "deltas": deltas,
    }


def _miss_reason(storage: Storage, workload: str | None, *, has_snapshots: bool) -> str:
    """Why nothing was found: the workload is unknown, has no snapshot, or none matches."""
    name = "no workload name" if workload is None else f"workload {workload!r}"
    if has_snapshots:
        return f"no snapshot of {name} matches this node"
    if workload is not None and storage.catalog.workload_row(workload) is None:
        return f"no workload {workload!r} is registered on this server, and no snapshot names it"
    return f"{name} has no snapshot yet"


def _neg(text: str) -> tuple[int, ...]:
    """A key that sorts ISO timestamps newest first."""
    return tuple(-ord(c) for c in text)


@router.post("/resolve", response_model=ResolveAnswer, responses=error_responses(InvalidManifest))
def resolve_route(
    body: ResolveRequest, request: Request, storage: StorageDep, _: ReadScope
) -> dict[str, Any]:
    """The best snapshot for a node's fingerprint and workload, plus the nearest misses."""
    try:
        answer = resolve(storage, body)
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidManifest(f"fingerprint cannot be compared: {exc}") from exc
    outcome = (
        "miss"
        if answer["snapshot"] is None
        else ("verified" if answer["verified"] else "unverified")
    )
    metrics_of(request).inc("cachekeeper_resolves_total", outcome=outcome)
    return answer
