"""``POST /v1/resolve``: the best snapshot for a node, or a miss with the nearest misses.

The ranking is ``server/resolver.py``'s. A miss is a value (200 with ``"snapshot": null``),
never an error; its ``reason`` says which miss it is: no snapshot matches, the workload
has no snapshot yet, or no workload of that name is registered.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request

from cachekeeper.errors import InvalidManifest
from cachekeeper.wire import ResolveAnswer, ResolveRequest

from .auth import ReadScope
from .deps import StorageDep, metrics_of
from .responses import error_responses

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["resolve"])


@router.post("/resolve", response_model=ResolveAnswer, responses=error_responses(InvalidManifest))
def resolve_route(
    body: ResolveRequest, request: Request, storage: StorageDep, _: ReadScope
) -> dict[str, Any]:
    """The best snapshot for a node's fingerprint and workload, plus the nearest misses."""
    try:
        answer = storage.resolve(
            fingerprint=body.fingerprint,
            workload=body.workload,
            driver_policy=body.driver_policy,
            devices=None if body.devices is None else list(body.devices),
        )
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidManifest(f"fingerprint cannot be compared: {exc}") from exc
    outcome = (
        "miss" if answer.snapshot is None else ("verified" if answer.verified else "unverified")
    )
    metrics_of(request).inc("cachekeeper_resolves_total", outcome=outcome)
    return asdict(answer)
