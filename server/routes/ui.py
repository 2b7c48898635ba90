"""The status page: ``GET /`` (and ``/ui``), server-rendered with Jinja2, no JS build step.

Pages: ``/ui`` (the matrix, agents, recent snapshots, the plot), ``/ui/cell`` (one
workload x environment: the full fingerprint, the last report and its traceback, the
pair's snapshots), ``/ui/login`` and ``/ui/logout``. Admin actions are POST forms:
``/ui/snapshots/{id}/pin``, ``.../unpin``, ``.../delete`` and ``/ui/gc``.

Auth, when the server has tokens: the login form takes a token once and keeps it in the
``ck_token`` cookie (HttpOnly, SameSite=Strict, Secure over https), never in a URL. Every
page derives its scope from that cookie with the same ``scope_of_token`` the bearer auth
uses; without a cookie a page redirects to the login (unless ``anonymous_read``). Admin
buttons are rendered only for an admin scope, and the admin routes check the scope again.

CSRF: each browser gets a random ``ck_csrf`` cookie (HttpOnly, SameSite=Strict); every
form carries the same value in a hidden ``csrf`` field, and a POST whose field does not
match its cookie is refused (403) before anything runs. Another site can neither read the
cookie nor, with SameSite=Strict, make the browser send it.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool

from cachekeeper.errors import SnapshotNotFound
from cachekeeper.integrity import DIGEST_PATTERN
from cachekeeper.server.auth import scope_of_token
from cachekeeper.server.deps import ServicesDep, read_body, services_of
from cachekeeper.server.resources.tier import summary as tier_summary
from cachekeeper.server.settings import Settings
from cachekeeper.server.ui_view import (
    STATES,
    fingerprint_json,
    human_bytes,
    page_data,
    plain,
    size_plot_svg,
)

__all__ = ["router"]

router = APIRouter(include_in_schema=False)

TOKEN_COOKIE = "ck_token"
CSRF_COOKIE = "ck_csrf"
_STATIC = Path(__file__).parent.parent / "static"  # package data of cachekeeper.server
_RANK = {"read": 0, "write": 1, "admin": 2}
_FORM_LIMIT = 16 * 1024


async def _form(request: Request) -> dict[str, str]:
    """A small urlencoded form (no multipart: the page's forms never upload files)."""
    body = await read_body(request, limit=_FORM_LIMIT, what="form")
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items()}


def _templates(request: Request) -> Environment:
    env = getattr(request.app.state, "ui_templates", None)
    if env is None:
        env = Environment(
            loader=PackageLoader("cachekeeper.server", "templates"),
            autoescape=select_autoescape(["html"]),
        )
        env.filters["bytes"] = human_bytes
        env.filters["pct"] = lambda v: "-" if v is None else f"{v:.0%}"
        request.app.state.ui_templates = env
    return env


def _scope(request: Request) -> str | None:
    """The page's scope: from the token cookie, "admin" with auth off, None if not logged in."""
    settings: Settings = request.app.state.settings
    if not settings.auth_enabled:
        return "admin"
    token = request.cookies.get(TOKEN_COOKIE)
    if token:
        found = scope_of_token(settings, token)
        if found is not None:
            return found
    return "read" if settings.anonymous_read else None


def _csrf(request: Request) -> str:
    return request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)


def _render(request: Request, name: str, *, status_code: int = 200, **context: Any) -> HTMLResponse:
    csrf = _csrf(request)
    auth = request.app.state.settings.auth_enabled
    html = _templates(request).get_template(name).render(csrf=csrf, auth=auth, **context)
    response = HTMLResponse(html, status_code=status_code)
    if request.cookies.get(CSRF_COOKIE) != csrf:
        _set_cookie(request, response, CSRF_COOKIE, csrf)
    response.headers["Cache-Control"] = "no-store"
    response.headers["Content-Security-Policy"] = (
        "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline';"
        " frame-ancestors 'none'; form-action 'self'"
    )
    return response


def _set_cookie(request: Request, response: Response, name: str, value: str) -> None:
    response.set_cookie(
        name,
        value,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )


def _to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/ui/login?next={quote(target, safe='')}", status_code=303)


def _safe_next(target: str) -> str:
    """Only a path on this server (never ``//host`` or a scheme)."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/ui"
    return target


def _check_post(request: Request, csrf: str, *, need: str) -> str | Response:
    """The scope for an admin POST, or the refusal page."""
    cookie = request.cookies.get(CSRF_COOKIE) or ""
    if not cookie or not hmac.compare_digest(cookie.encode(), csrf.encode()):
        return _render(
            request, "message.html", status_code=403, title="Refused",
            message="the form's CSRF token does not match this browser's; reload the page",
        )  # fmt: skip
    scope = _scope(request)
    if scope is None:
        return _to_login(request)
    if _RANK[scope] < _RANK[need]:
        return _render(
            request, "message.html", status_code=403, title="Forbidden",
            message=f"this action needs the {need!r} scope; your token has {scope!r}",
        )  # fmt: skip
    return scope


@router.get("/", response_class=HTMLResponse)
@router.get("/ui", response_class=HTMLResponse)
def index(request: Request, services: ServicesDep) -> Response:
    scope = _scope(request)
    if scope is None:
        return _to_login(request)
    data = page_data(services)
    plot = size_plot_svg(
        [plain(s) for s in services.snapshots.summaries(limit=10_000)],
        services.reports.restores_by_day(),
    )
    state = request.app.state
    tier = (
        None
        if state.tier is None
        else tier_summary(state.tier, state.metrics, state.settings, port=state.resp.port)
    )
    return _render(
        request,
        "index.html",
        data=data,
        states=STATES,
        scope=scope,
        plot=plot,
        tier=tier,
    )


@router.get("/ui/cell", response_class=HTMLResponse)
def cell(
    request: Request,
    services: ServicesDep,
    workload: Annotated[str, Query(max_length=128)],
    digest: Annotated[str, Query(pattern=DIGEST_PATTERN)],
) -> Response:
    scope = _scope(request)
    if scope is None:
        return _to_login(request)
    data = page_data(services)
    found = data.cells.get((workload, digest))
    if found is None:
        return _render(
            request, "message.html", status_code=404, title="Not found",
            message=f"no status for workload {workload!r} in environment {digest[:12]}",
        )  # fmt: skip
    environment = next(e for e in data.environments if e.digest == digest)
    snapshots = [
        plain(s) for s in services.snapshots.summaries(workload=workload, fingerprint_digest=digest)
    ]
    return _render(
        request,
        "cell.html",
        cell=found,
        environment=environment,
        fingerprint=fingerprint_json(environment.fingerprint),
        snapshots=snapshots,
        scope=scope,
        states=dict((s, label) for s, label, _ in STATES),
    )


@router.get("/ui/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/ui") -> Response:
    return _render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/ui/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    settings: Settings = request.app.state.settings
    form = await _form(request)
    token, csrf = form.get("token", ""), form.get("csrf", "")
    target = _safe_next(form.get("next", "/ui"))
    cookie = request.cookies.get(CSRF_COOKIE) or ""
    if not cookie or not hmac.compare_digest(cookie.encode(), csrf.encode()):
        return _render(
            request, "login.html", status_code=403, next=target,
            error="the form expired; try again",
        )  # fmt: skip
    if scope_of_token(settings, token.strip()) is None:
        return _render(
            request, "login.html", status_code=401, next=target,
            error="this token is not known to the server",
        )  # fmt: skip
    response = RedirectResponse(target, status_code=303)
    _set_cookie(request, response, TOKEN_COOKIE, token.strip())
    return response


@router.post("/ui/logout")
def logout(request: Request) -> Response:
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(TOKEN_COOKIE, path="/")
    return response


def _after(request: Request, message: str) -> Response:
    return _render(request, "message.html", title="Done", message=message, back="/ui")


@router.post("/ui/snapshots/{snapshot_id}/{action}")
async def snapshot_action(request: Request, snapshot_id: str, action: str) -> Response:
    form = await _form(request)
    checked = _check_post(request, form.get("csrf", ""), need="admin")
    if isinstance(checked, Response):
        return checked
    if action not in ("pin", "unpin", "delete") or len(snapshot_id) != 64:
        return _render(
            request, "message.html", status_code=404, title="Not found",
            message=f"no action {action!r} on snapshot {snapshot_id[:12]}",
        )  # fmt: skip
    services = services_of(request)
    try:
        if action == "delete":
            await run_in_threadpool(services.snapshots.delete, snapshot_id)
        else:
            await run_in_threadpool(
                services.snapshots.set_pinned, snapshot_id, pinned=action == "pin"
            )
    except SnapshotNotFound:
        return _render(
            request, "message.html", status_code=404, title="Not found",
            message=f"no snapshot {snapshot_id[:12]} on this server",
        )  # fmt: skip
    verb = {"pin": "pinned", "unpin": "unpinned", "delete": "deleted"}[action]
    return _after(request, f"snapshot {snapshot_id[:12]} {verb}")


@router.post("/ui/gc")
async def gc(request: Request) -> Response:
    form = await _form(request)
    checked = _check_post(request, form.get("csrf", ""), need="admin")
    if isinstance(checked, Response):
        return checked
    services = services_of(request)
    plan = await run_in_threadpool(services.gc.plan)
    await run_in_threadpool(services.gc.execute, plan)
    return _after(
        request,
        f"GC evicted {len(plan.snapshots_evicted)} snapshot(s) and freed"
        f" {human_bytes(plan.bytes_freed)}",
    )


@router.get("/ui/static/ui.js")
def script() -> Response:
    return Response(
        (_STATIC / "ui.js").read_bytes(),
        media_type="text/javascript",
        headers={"Cache-Control": "max-age=300"},
    )
