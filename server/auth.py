"""Bearer-token auth with ordered scopes ``read < write < admin``.

With no tokens configured, auth is off and every route is open (a single-user laptop
server). With tokens, a request needs ``Authorization: Bearer TOKEN`` whose scope covers the
route's: missing or unknown is 401, too low is 403 (both name the route's ``scope``); read routes may be opened to anonymous
callers with ``anonymous_read``. A route may also answer by the scope it was granted
(``covers``): ``POST /v1/blobs/missing`` is a read route, but hands out presigned upload
URLs (a write into the object store) only to a write-scope caller. Tokens are compared in constant time (every configured
token is compared, so timing does not reveal which one matched) and never logged.

A request with a body is judged twice by the same rule (``admit``): first from its headers
by ``RequestLimits``, before a byte of the body is read (``refusal_before_body``, with each
route's scope listed once by ``route_scopes`` at ``create_app``), so a caller without a good token cannot
make the server read and screen megabytes of JSON; then by the route's own dependency.

A route that attributes what it stores to its caller (``POST /v1/reports``) needs a token
even where ``anonymous_read`` opens the other read routes (``identified``), and names the
caller by ``token_id``: a stable, non-secret name of a configured token (a short hash),
stored with the rows it writes and counted in per-token budgets.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, NamedTuple

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import Scope

from cachekeeper.errors import CachekeeperError, Forbidden, Unauthorized

from .settings import SCOPES, Settings

__all__ = [
    "Need",
    "admit",
    "covers",
    "identified",
    "token_id",
    "refusal_before_body",
    "require",
    "scope_of_token",
    "presented_token",
    "token_id",
    "ReadScope",
    "WriteScope",
    "AdminScope",
]

_RANK = {scope: i for i, scope in enumerate(SCOPES)}


class Need(NamedTuple):
    """What a route asks of its caller: a scope, and (``identified``) a token of its own,
    which ``anonymous_read`` does not stand in for."""

    scope: str
    identified: bool = False


_CHECKS: dict[Callable[..., Any], Need] = {}  # each ``require``/``identified`` dependency


def token_id(presented: str) -> str:
    """A stable, non-secret name for a configured token: ``tok-`` and the first 12 hex
    digits of its sha256. Stored with what the token wrote (tier keys, job reports), never
    the token itself, and never a name the client claims."""
    return "tok-" + hashlib.sha256(presented.encode("utf-8")).hexdigest()[:12]


def scope_of_token(settings: Settings, presented: str) -> str | None:
    """The scope of ``presented`` if it is a configured token, else None (constant time)."""
    found: str | None = None
    given = presented.encode()
    for token, scope in settings.tokens.items():
        if hmac.compare_digest(token.encode(), given):
            found = scope
    return found


def presented_token(request: Request) -> str | None:
    """The bearer token ``request`` presents (None: none), as the scope check read it."""
    return _bearer(request.headers)


def covers(granted: str, scope: str) -> bool:
    """Whether a caller ``granted`` one scope may do what ``scope`` allows."""
    return _RANK[granted] >= _RANK[scope]


def _bearer(headers: Mapping[str, str]) -> str | None:
    header = headers.get("authorization")
    if header is None:
        return None
    kind, _, value = header.partition(" ")
    if kind.lower() != "bearer" or not value.strip():
        raise Unauthorized("the Authorization header is not 'Bearer TOKEN'")
    return value.strip()


def admit(
    settings: Settings, scope: str, presented: str | None, *, identified: bool = False
) -> str:
    """The scope granted to a caller presenting ``presented`` (None: no token) on a route
    that needs ``scope``; Unauthorized (401) or Forbidden (403) when it is not admitted.
    ``identified``: the route attributes what it stores to the token, so ``anonymous_read``
    does not admit a caller without one."""
    if not settings.auth_enabled:
        return "admin"
    if presented is None:
        if scope == "read" and settings.anonymous_read and not identified:
            return "read"
        why = " (what it stores is attributed to the token that sent it)" if identified else ""
        raise Unauthorized(
            f"this route needs a bearer token with the {scope!r} scope{why}",
            extra={"scope": scope},
        )
    granted = scope_of_token(settings, presented)
    if granted is None:
        raise Unauthorized("the bearer token is not known to this server", extra={"scope": scope})
    if not covers(granted, scope):
        raise Forbidden(
            f"this route needs the {scope!r} scope; the token has {granted!r}",
            extra={"scope": scope, "granted": granted},
        )
    return granted


def require(scope: str) -> Callable[[Request], Awaitable[str]]:
    """A dependency that admits requests whose token covers ``scope``; returns the scope.

    A coroutine, though it never waits: FastAPI runs a plain function's dependency in its
    thread pool, a hop that cost more CPU than the check itself (the per-key tier's GET,
    which a herd of nodes asks, is measured in docs/benchmarks.md)."""

    async def check(request: Request) -> str:
        return admit(request.app.state.settings, scope, _bearer(request.headers))

    check.__name__ = f"require_{scope}"
    _CHECKS[check] = Need(scope)
    return check


def identified(scope: str) -> Callable[[Request], str | None]:
    """A dependency that admits only a caller whose own token covers ``scope`` (with auth
    on; ``anonymous_read`` is not enough) and returns its ``token_id``; None with auth off
    (every caller is the same anonymous one)."""

    def check(request: Request) -> str | None:
        settings: Settings = request.app.state.settings
        presented = _bearer(request.headers)
        admit(settings, scope, presented, identified=True)
        if not settings.auth_enabled or presented is None:
            return None
        return token_id(presented)

    check.__name__ = f"identified_{scope}"
    _CHECKS[check] = Need(scope, identified=True)
    return check


ReadScope = Annotated[str, Depends(require("read"))]
WriteScope = Annotated[str, Depends(require("write"))]
AdminScope = Annotated[str, Depends(require("admin"))]


def refusal_before_body(
    settings: Settings, routes: Sequence[tuple[APIRoute, Need]], asgi: Scope, headers: Headers
) -> CachekeeperError | None:
    """The 401 or 403 that the route of ``routes`` (``route_scopes``) matching the request
    ``asgi`` would answer, decided from its ``headers`` alone, or None. ``RequestLimits``
    asks before it reads a body, so a caller without a good token never makes the server
    read (and screen) a megabyte of JSON."""
    if not settings.auth_enabled:
        return None
    needed = next((n for route, n in routes if route.matches(asgi)[0] is Match.FULL), None)
    if needed is None:
        return None
    try:
        admit(settings, needed.scope, _bearer(headers), identified=needed.identified)
    except (Unauthorized, Forbidden) as exc:
        return exc
    return None


def route_scopes(routes: Sequence[Any]) -> list[tuple[APIRoute, Need]]:
    """Each route of ``routes`` (a router's, as declared) that needs a scope, with it."""
    return [
        (route, needed)
        for route in routes
        if isinstance(route, APIRoute)
        and (needed := _needed(route.dependant.dependencies)) is not None
    ]


def _needed(dependencies: Sequence[Any]) -> Need | None:
    for dependency in dependencies:
        needed = _CHECKS.get(dependency.call) or _needed(dependency.dependencies)
        if needed is not None:
            return needed
    return None
