"""``/v1/tier/...``: the per-key tier over HTTP, for cachekeeper's own remote-cache backend.

The RESP port (``server/resp/listener.py``) serves torch's stock redis-py path; these routes serve
the backend that prejob loads into a job's Python processes (``cachekeeper/_tier_hook/``),
with the token in the ``Authorization`` header and TLS when the server has it. Why HTTP and
not RESP: docs/server.md, "The per-key tier over HTTP".

- ``GET /v1/tier/values/{key}``: 404 on a miss (a small JSON body); else the value with
  ``X-Cachekeeper-Digest`` and ``X-Cachekeeper-Size``, either as the body (a local store)
  or as a 307 to a short-lived presigned GET of the object store, which the node fetches
  without its token and checks itself (size and sha256: a store may check nothing). The
  reader names its environment (``X-Cachekeeper-Environment``); a value written from
  another is a miss unless the server crosses environments.
- ``POST /v1/tier/puts`` (``TierPutRequest``): a small question before any bytes move;
  the answer (``TierPutAnswer``) says whether the server already has the bytes
  (``stored``), wants them here (``send``) or in the object store (``upload``, then
  ``POST /v1/tier/commits``), or drops the put and why. A read-scope caller is answered
  ``dropped``/``read_only_token`` (as the RESP port does), never with an error.
- ``PUT /v1/tier/values/{key}``: the value's bytes (write scope), hashed by the server,
  refused on a digest or size mismatch.
- ``POST /v1/tier/commits`` (write scope): after an upload, the server reads the object
  back, checks its size and sha256, and only then points the key at it.

A key's writer is the token (``auth.token_id``) that wrote it, never a name the client
claims. 404 on every route when the server serves no tier.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from cachekeeper.errors import (
    BlobMissing,
    DigestMismatch,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
)
from cachekeeper.integrity import DIGEST_PATTERN, digest_of
from cachekeeper.server.auth import ReadScope, WriteScope, covers, presented_token, token_id
from cachekeeper.server.deps import SettingsDep, metrics_of, read_body
from cachekeeper.server.metrics import Metrics
from cachekeeper.server.resources.tier import Tier, TierPut
from cachekeeper.server.responses import error_responses
from cachekeeper.server.settings import Settings
from cachekeeper.wire import TierCommitRequest, TierPutAnswer, TierPutRequest, to_dict
from cachekeeper.wire.tier import ENVIRONMENT_PATTERN, MAX_TIER_KEY_LENGTH

__all__ = ["DIGEST_HEADER", "ENVIRONMENT_HEADER", "SIZE_HEADER", "router"]

router = APIRouter(prefix="/v1/tier", tags=["tier"])

DIGEST_HEADER = "X-Cachekeeper-Digest"
SIZE_HEADER = "X-Cachekeeper-Size"
ENVIRONMENT_HEADER = "X-Cachekeeper-Environment"

# No newline: Starlette's path converter never matches one, so such a key could reach no
# route (a 404 before the token was looked at); the schema says so.
Key = Annotated[
    str,
    Path(max_length=MAX_TIER_KEY_LENGTH, pattern=r"^[^\n]+$", description="torch's cache key"),
]
EnvironmentHeader = Annotated[
    str,
    Header(
        alias=ENVIRONMENT_HEADER,
        pattern=ENVIRONMENT_PATTERN,
        description="the caller's environment: 12 hex digits of its fingerprint digest",
    ),
]
_NO_TIER = "this server serves no per-key tier (serve --resp-port PORT)"


def _tier(request: Request) -> Tier:
    tier: Tier | None = request.app.state.tier
    if tier is None:
        raise NotFound(_NO_TIER)
    return tier


def _writer(request: Request, scope: str, environment: str) -> dict[str, Any]:
    """Who writes: the token's id (or None with auth off), its scope, the environment."""
    presented = presented_token(request)
    return {
        "token": None if presented is None else token_id(presented),
        "scope": scope,
        "environment": environment,
        "via": "http",
        "peer": request.client.host if request.client else "",
    }


def _key(key: str) -> bytes:
    raw = key.encode()
    if not raw or len(raw) > MAX_TIER_KEY_LENGTH:
        raise InvalidRequest(f"a tier key has 1 to {MAX_TIER_KEY_LENGTH} bytes")
    return raw


@router.get(
    "/values/{key:path}",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the value"},
        307: {"description": "the value, at a presigned object-store URL (Location)"},
        **error_responses((404, NotFound)),
    },
)
async def get_value(
    key: Key,
    request: Request,
    settings: SettingsDep,
    _: ReadScope,
    environment: EnvironmentHeader = "",
) -> Response:
    """The value of torch's ``key``: 200 with the bytes, or 307 to the object store; both
    with the value's sha256 and size, which the caller checks. 404: a miss.

    A coroutine: the key's look-up is one indexed SQLite read, and a herd of nodes asks
    this route, so it costs no thread-pool hop; only reading a value from the local store
    goes to a thread."""
    tier = _tier(request)
    metrics = metrics_of(request)
    raw = _key(key)
    entry, why = tier.lookup(raw, environment=environment)
    direct = tier.blobs.direct_access()
    if entry is not None and direct is not None:
        metrics.inc("cachekeeper_remote_cache_gets_total", result="hit")
        metrics.inc("cachekeeper_remote_cache_bytes_total", entry.size_bytes, direction="direct")
        url = direct.blob_url(entry.digest, expires_s=settings.presign_expires_s)
        return Response(
            status_code=307,
            headers={
                "Location": url,
                DIGEST_HEADER: entry.digest,
                SIZE_HEADER: str(entry.size_bytes),
            },
        )
    value = None
    if entry is not None:  # read, decompressed and checked off the event loop
        value, why = await run_in_threadpool(tier.fetch, raw, environment=environment)
    if value is None:
        metrics.inc("cachekeeper_remote_cache_gets_total", result=why)
        return JSONResponse(
            {"error": "not_found", "detail": "no value for this key"}, status_code=404
        )
    metrics.inc("cachekeeper_remote_cache_gets_total", result="hit")
    metrics.inc("cachekeeper_remote_cache_bytes_total", len(value), direction="out")
    return Response(
        content=value,
        media_type="application/octet-stream",
        headers={DIGEST_HEADER: digest_of(value), SIZE_HEADER: str(len(value))},
    )


def _dropped(metrics: Metrics, reason: str) -> dict[str, Any]:
    metrics.inc("cachekeeper_remote_cache_puts_total", result=reason)
    return to_dict(TierPutAnswer(action="dropped", reason=reason))


def _refusal(settings: Settings, tier: Tier, scope: str, size_bytes: int) -> str | None:
    """Why a put of ``size_bytes`` from a caller with ``scope`` is dropped, or None."""
    if not covers(scope, "write"):
        return "read_only_token"
    if not settings.remote_cache_writable:
        return "signatures_required"
    if size_bytes > tier.max_value_bytes:
        return "too_large"
    return None


def _stored(metrics: Metrics, done: TierPut, size_bytes: int) -> dict[str, Any]:
    if not done.stored:
        return _dropped(metrics, done.reason or "dropped")
    metrics.inc("cachekeeper_remote_cache_puts_total", result="stored")
    metrics.inc("cachekeeper_remote_cache_bytes_total", size_bytes, direction="in")
    if done.evicted:
        metrics.inc("cachekeeper_remote_cache_evictions_total", done.evicted)
    return to_dict(TierPutAnswer(action="stored"))


@router.post("/puts", response_model=TierPutAnswer, responses=error_responses(NotFound))
def plan_put(
    body: TierPutRequest, request: Request, settings: SettingsDep, scope: ReadScope
) -> dict[str, Any]:
    """Where a value's bytes go, before any move: ``stored`` (the server has them; the key
    now points at them), ``send`` (PUT them here), ``upload`` (to the object store, then
    commit), or ``dropped`` with why (``read_only_token``, ``signatures_required``,
    ``too_large``)."""
    tier = _tier(request)
    metrics = metrics_of(request)
    reason = _refusal(settings, tier, scope, body.size_bytes)
    if reason is not None:
        return _dropped(metrics, reason)
    if tier.has_value(body.digest):
        writer = _writer(request, scope, body.environment)
        done = tier.record(
            _key(body.key), digest=body.digest, size_bytes=body.size_bytes, writer=writer
        )
        return _stored(metrics, done, body.size_bytes)
    direct = tier.blobs.direct_access()
    if direct is None:
        return to_dict(TierPutAnswer(action="send"))
    target = direct.upload_target(body.digest, expires_s=settings.presign_expires_s)
    return to_dict(TierPutAnswer(action="upload", url=target.url, headers=target.headers))


@router.put(
    "/values/{key:path}",
    status_code=201,
    response_model=TierPutAnswer,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        }
    },
    responses={
        200: {"model": TierPutAnswer, "description": "dropped (reason says why)"},
        **error_responses(DigestMismatch, PayloadTooLarge, NotFound),
    },
)
async def put_value(
    key: Key,
    request: Request,
    scope: WriteScope,
    digest: Annotated[str, Header(alias=DIGEST_HEADER, pattern=DIGEST_PATTERN)],
    environment: EnvironmentHeader = "",
) -> JSONResponse:
    """Store the body as the value of ``key``; its sha256 must be ``X-Cachekeeper-Digest``
    (else 422 ``digest_mismatch`` and nothing is stored)."""
    tier = _tier(request)
    settings: Settings = request.app.state.settings
    metrics = metrics_of(request)
    raw = _key(key)
    value = await read_body(request, limit=tier.max_value_bytes, what="a tier value")
    reason = _refusal(settings, tier, scope, len(value))
    if reason is not None:
        return JSONResponse(_dropped(metrics, reason), status_code=200)
    if digest_of(value) != digest:
        raise DigestMismatch(f"the tier value's sha256 is not {digest}")
    writer = _writer(request, scope, environment)
    done = await run_in_threadpool(tier.put, raw, value, writer=writer)
    answer = _stored(metrics, done, len(value))
    return JSONResponse(answer, status_code=201 if done.stored else 200)


@router.post(
    "/commits",
    status_code=201,
    response_model=TierPutAnswer,
    responses={
        200: {"model": TierPutAnswer, "description": "dropped (reason says why)"},
        **error_responses(DigestMismatch, NotFound),
    },
)
def commit_upload(body: TierCommitRequest, request: Request, scope: WriteScope) -> JSONResponse:
    """Point ``key`` at a value uploaded to the object store, once read back and checked
    (its size and sha256; a store may check neither). A wrong object is deleted."""
    tier = _tier(request)
    settings: Settings = request.app.state.settings
    metrics = metrics_of(request)
    reason = _refusal(settings, tier, scope, body.size_bytes)
    if reason is not None:
        return JSONResponse(_dropped(metrics, reason), status_code=200)
    try:
        with tier.blobs.open(body.digest) as fh:
            value = fh.read(tier.max_value_bytes + 1)
    except BlobMissing as exc:
        raise NotFound(f"tier value {body.digest} was not uploaded") from exc
    if len(value) != body.size_bytes or digest_of(value) != body.digest:
        tier.blobs.delete(body.digest)  # our prefix, bytes that are not what they claim
        raise DigestMismatch(
            f"the uploaded tier value is not {body.size_bytes} bytes of sha256 {body.digest}"
        )
    writer = _writer(request, scope, body.environment)
    done = tier.record(_key(body.key), digest=body.digest, size_bytes=len(value), writer=writer)
    return JSONResponse(_stored(metrics, done, len(value)), status_code=201)
