"""Bearer-token auth with ordered scopes ``read < write < admin``.

With no tokens configured, auth is off and every route is open (a single-user laptop
server). With tokens, a request needs ``Authorization: Bearer TOKEN`` whose scope covers the
route's: missing or unknown is 401, too low is 403 (both name the route's ``scope``); read routes may be opened to anonymous
callers with ``anonymous_read``. A route may also answer by the scope it was granted
(``covers``): ``POST /v1/blobs/missing`` is a read route, but hands out presigned upload
URLs (a write into the object store) only to a write-scope caller. Tokens are compared in constant time (every configured
token is compared, so timing does not reveal which one matched) and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request

from cachekeeper.errors import Forbidden, Unauthorized

from .settings import SCOPES, Settings

__all__ = ["covers", "require", "scope_of_token", "ReadScope", "WriteScope", "AdminScope"]

_RANK = {scope: i for i, scope in enumerate(SCOPES)}


def scope_of_token(settings: Settings, presented: str) -> str | None:
    """The scope of ``presented`` if it is a configured token, else None (constant time)."""
    found: str | None = None
    given = presented.encode()
    for token, scope in settings.tokens.items():
        if hmac.compare_digest(token.encode(), given):
            found = scope
    return found


def covers(granted: str, scope: str) -> bool:
    """Whether a caller ``granted`` one scope may do what ``scope`` allows."""
    return _RANK[granted] >= _RANK[scope]


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    kind, _, value = header.partition(" ")
    if kind.lower() != "bearer" or not value.strip():
        raise Unauthorized("the Authorization header is not 'Bearer TOKEN'")
    return value.strip()


def require(scope: str) -> Callable[[Request], str]:
    """A dependency that admits requests whose token covers ``scope``; returns the scope."""

    def check(request: Request) -> str:
        settings: Settings = request.app.state.settings
        if not settings.auth_enabled:
            return "admin"
        presented = _bearer(request)
        if presented is None:
            if scope == "read" and settings.anonymous_read:
                return "read"
            raise Unauthorized(
                f"this route needs a bearer token with the {scope!r} scope",
                extra={"scope": scope},
            )
        granted = scope_of_token(settings, presented)
        if granted is None:
            raise Unauthorized(
                "the bearer token is not known to this server", extra={"scope": scope}
            )
        if not covers(granted, scope):
            raise Forbidden(
                f"this route needs the {scope!r} scope; the token has {granted!r}",
                extra={"scope": scope, "granted": granted},
            )
        return granted

    check.__name__ = f"require_{scope}"
    return check


ReadScope = Annotated[str, Depends(require("read"))]
WriteScope = Annotated[str, Depends(require("write"))]
AdminScope = Annotated[str, Depends(require("admin"))]
