"""``POST /v1/resolve``: the best snapshot for a node, or a miss with the nearest misses;
``GET /v1/remote-cache``: the per-key tier as offered to the caller.

The ranking is ``server/resources/resolve.py``'s. A miss is a value (200 with ``"snapshot": null``),
never an error; its ``reason`` says which miss it is: no snapshot matches, the workload
has no snapshot yet, no workload of that name is registered, or (for a node that sent
``trusted_keys``) none that matches is signed by one of its keys (``server/trust.py``).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from fastapi import APIRouter, Request

from cachekeeper.environment.fingerprint import parse
from cachekeeper.errors import InvalidManifest, InvalidRequest, NotFound
from cachekeeper.server.auth import ReadScope
from cachekeeper.server.deps import ServicesDep, metrics_of
from cachekeeper.server.resources.tier import offer_for
from cachekeeper.server.responses import error_responses
from cachekeeper.server.trust import parse_trusted_keys
from cachekeeper.wire import RemoteCacheOffer, ResolveAnswer, ResolveRequest

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["resolve"])


@router.post("/resolve", response_model=ResolveAnswer, responses=error_responses(InvalidManifest))
def resolve_route(
    body: ResolveRequest, request: Request, services: ServicesDep, scope: ReadScope
) -> dict[str, Any]:
    """The best snapshot for a node's fingerprint and workload, plus the nearest misses.

    A hook that sends ``remote_cache`` gets the per-key tier's offer, and its snapshots are
    ranked for the environment its job runs in (the tier's switches are in torch's keys).
    A node that sends ``trusted_keys`` gets only a snapshot whose signature the server
    checked against one of those keys.
    """
    devices = None if body.devices is None else list(body.devices)
    fingerprint = parse(body.fingerprint)  # a bad field is a 422 that names it
    trust = None
    if body.trusted_keys is not None:
        try:
            trust = services.resolver.node_trust(parse_trusted_keys(body.trusted_keys))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
    try:
        offer = None
        if body.remote_cache is not None:
            offer = remote_cache_offer(request, scope=scope, wish=body.remote_cache)
        if offer is None:  # an old hook, or no tier here: the job runs as the hook sent it
            answer = services.resolver.resolve(
                fingerprint=fingerprint,
                workload=body.workload,
                driver_policy=body.driver_policy,
                devices=devices,
                trust=trust,
            )
        else:
            answer, switches = services.resolver.resolve_for_job(
                fingerprint=fingerprint,
                switches=offer.switches,
                workload=body.workload,
                driver_policy=body.driver_policy,
                devices=devices,
                trust=trust,
            )
            answer = replace(answer, remote_cache=replace(offer, switches=switches))
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidManifest(f"fingerprint cannot be compared: {exc}") from exc
    outcome = (
        "miss" if answer.snapshot is None else ("verified" if answer.verified else "unverified")
    )
    metrics_of(request).inc("cachekeeper_resolves_total", outcome=outcome)
    return asdict(answer)


def remote_cache_offer(
    request: Request, *, scope: str, wish: str | None
) -> RemoteCacheOffer | None:
    """The per-key tier as this server offers it to the caller (None: it serves none)."""
    resp = request.app.state.resp
    return offer_for(
        request.app.state.settings,
        port=None if resp is None else resp.port,
        scope=scope,
        wish=wish,
    )


@router.get(
    "/remote-cache",
    response_model=RemoteCacheOffer,
    responses=error_responses(NotFound),
    tags=["remote-cache"],
)
def remote_cache_route(request: Request, scope: ReadScope) -> RemoteCacheOffer:
    """The per-key tier (torch's remote caches through redis-py) as this server offers it
    to the caller: its RESP port, whether jobs use it by default, whether this token may
    write, and the torch switches jobs and builders run with. 404 when it serves none."""
    offer = remote_cache_offer(request, scope=scope, wish="auto")
    if offer is None:
        raise NotFound("this server serves no per-key tier (serve --resp-port PORT)")
    return offer
