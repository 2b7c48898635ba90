"""Bounds on every request body: a size limit per route, an idle timeout, a JSON screen.

``RequestLimits`` is a pure ASGI middleware that ``create_app`` installs in front of every
route, so no route can forget it:

- **Auth first.** A request whose headers already earn the route's 401 or 403 (no token,
  an unknown one, too low a scope: ``auth.refusal_before_body``) gets it before its body
  is read.
- **Size.** Each route has a body limit (``body_rule``): a blob upload ``max_blob_bytes``
  (plus slack for a zstd body, whose decoded size the upload bounds itself), a manifest
  ``max_manifest_bytes``, a tier value ``remote_cache_max_value_bytes``, a workload ``max_workload_bytes``, every other body
  ``max_json_bytes``. A declared ``Content-Length`` over it is refused (413) before a byte is
  read; a body that grows past it (chunked, or lying) is cut off at the limit.
- **Time.** A body that sends nothing for ``body_timeout_s`` is cut off (408), so a stalled
  client cannot hold a request (and what it holds: a thread, a temp file) open forever.
- **JSON.** Bodies that routes parse as JSON are read whole (they are bounded) and screened
  before any parser sees them: nesting deeper than ``MAX_JSON_DEPTH`` (Python's parser would
  raise RecursionError, a 500 the client retries) and non-finite numbers (``NaN``,
  ``Infinity``, ``1e999``, which Python reads and then serves back as invalid JSON) are 422.

When a limit cuts a body off, the route sees the client disconnect (it stores nothing) and
the client gets the refusal with ``Connection: close`` instead of whatever the route answered.
Blob uploads stream through unbuffered; their worker threads are bounded separately
(``upload_limiter``), so uploads never take the threads that health, resolve and archive use.
The store's hard cap on what uploads add is not a request bound: ``server/capacity.py``.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import anyio
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachekeeper.errors import (
    CachekeeperError,
    InvalidManifest,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
)

from .auth import Need, refusal_before_body
from .settings import Settings

__all__ = [
    "MAX_JSON_DEPTH",
    "BodyRule",
    "RequestLimits",
    "body_rule",
    "screen_json",
    "upload_limiter",
]

MAX_JSON_DEPTH = 64  # a manifest nests 4 levels; agents' and resolve's bodies fewer
ZSTD_SLACK_BYTES = 1 << 20  # a zstd body may be a little larger than its content

_BLOB_PATH = re.compile(r"^/v1/blobs/[^/]+$")
_WORKLOAD_PATH = re.compile(r"^/v1/workloads/[^/]+$")
# A JSON string, then the tokens the screen looks for outside strings.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NON_FINITE = re.compile(rb"NaN|Infinity")
_FLOAT = re.compile(rb"-?\d+(?:\.\d+)?[eE][+-]?\d+|-?\d+\.\d+")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [0] * 256
for _open in b"[{":
    _DEPTH_STEP[_open] = 1
for _close in b"]}":
    _DEPTH_STEP[_close] = -1


@dataclass(frozen=True)
class BodyRule:
    """How one route's request body is bounded."""

    limit_bytes: int
    what: str  # names the body in errors: "blob", "manifest", ...
    buffered: bool  # read whole before the route runs (else streamed through)
    json: bool  # screened as JSON (depth, non-finite numbers)
    invalid: type[CachekeeperError] = InvalidRequest


def body_rule(settings: Settings, *, method: str, path: str) -> BodyRule:
    """The body rule of ``method path``; every route has one."""
    if method == "PUT" and _BLOB_PATH.match(path):
        return BodyRule(settings.max_blob_bytes + ZSTD_SLACK_BYTES, "blob body", False, False)
    if method == "PUT" and path.startswith("/v1/tier/values/"):
        return BodyRule(settings.remote_cache_max_value_bytes, "tier value", True, False)
    if method == "POST" and path == "/v1/snapshots":
        return BodyRule(settings.max_manifest_bytes, "manifest", True, True, InvalidManifest)
    if method == "PUT" and _WORKLOAD_PATH.match(path):
        return BodyRule(settings.max_workload_bytes, "workload", True, False)
    if path.startswith("/ui/"):  # the status page's urlencoded forms (routes/ui.py), not JSON
        return BodyRule(settings.max_json_bytes, "form", True, False)
    return BodyRule(settings.max_json_bytes, "request body", True, True)


def screen_json(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why ``body`` must not reach a JSON parser (too deep, non-finite numbers), or None.

    Works on the bytes in linear time without recursion: strings are blanked first, so
    brackets and words inside them do not count.
    """
    bare = _STRING.sub(b'""', body)
    found = _NON_FINITE.search(bare)
    if found is not None:
        return f"non-finite number {found.group().decode()!r}: JSON numbers must be finite"
    for number in _FLOAT.finditer(bare):
        if not math.isfinite(float(number.group())):
            text = number.group()[:32].decode()
            return f"number {text!r} is out of range: JSON numbers must be finite"
    brackets = bare.translate(None, _NOT_BRACKETS)
    deepest = max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)
    if deepest > max_depth:
        return f"JSON nested deeper than {max_depth} levels"
    return None


def upload_limiter(app: FastAPI) -> anyio.CapacityLimiter:
    """The threads blob uploads may hold at once (``upload_workers``), one per app."""
    limiter: anyio.CapacityLimiter | None = getattr(app.state, "upload_limiter", None)
    if limiter is None:
        limiter = anyio.CapacityLimiter(app.state.settings.upload_workers)
        app.state.upload_limiter = limiter
    return limiter


class _Disconnected(Exception):
    """The client went away while sending its body."""


class _Body:
    """The client's body, read through the limit and the idle timeout."""

    def __init__(self, receive: Receive, rule: BodyRule, *, timeout_s: float) -> None:
        self._receive = receive
        self._rule = rule
        self._timeout_s = timeout_s
        self.received_bytes = 0
        self.done = False
        self.refusal: CachekeeperError | None = None

    async def next_message(self) -> Message:
        """The next message; on a limit, records the refusal and reports a disconnect."""
        if self.done:
            return await self._receive()  # only the disconnect is left to wait for
        if self.refusal is not None:
            return {"type": "http.disconnect"}
        try:
            message = await asyncio.wait_for(self._receive(), self._timeout_s)
        except TimeoutError:
            self.refusal = RequestTimeout(
                f"the {self._rule.what} sent nothing for {self._timeout_s:g} s"
                f" (after {self.received_bytes} bytes); send it without stalling"
            )
            return {"type": "http.disconnect"}
        if message["type"] == "http.request":
            self.received_bytes += len(message.get("body", b""))
            if self.received_bytes > self._rule.limit_bytes:
                self.refusal = PayloadTooLarge(
                    f"{self._rule.what} is over the limit of {self._rule.limit_bytes} bytes"
                )
                return {"type": "http.disconnect"}
            if not message.get("more_body", False):
                self.done = True
        elif message["type"] == "http.disconnect":
            self.done = True
        return message

    async def read_all(self) -> bytes:
        parts: list[bytes] = []
        while True:
            message = await self.next_message()
            if self.refusal is not None:
                raise self.refusal
            if message["type"] == "http.disconnect":
                raise _Disconnected
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(parts)


async def _answer(scope: Scope, receive: Receive, send: Send, exc: CachekeeperError) -> None:
    response = JSONResponse(
        exc.to_dict(), status_code=exc.http_status, headers={"Connection": "close"}
    )
    await response(scope, receive, send)


class RequestLimits:
    """ASGI middleware: every request body bounded in size and idle time; JSON screened."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: Settings,
        route_scopes: Sequence[tuple[APIRoute, Need]] = (),
    ) -> None:
        self.app = app
        self.settings = settings
        self.route_scopes = route_scopes  # auth.route_scopes: refused before the body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if "content-length" not in headers and "transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body
            return
        refused = refusal_before_body(self.settings, self.route_scopes, scope, headers)
        if refused is not None:
            await _answer(scope, receive, send, refused)
            return
        rule = body_rule(self.settings, method=scope["method"], path=scope["path"])
        declared = headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 19 or int(declared) > rule.limit_bytes):
            too_large = PayloadTooLarge(
                f"{rule.what} of {declared} bytes is over the limit of {rule.limit_bytes} bytes"
            )
            await _answer(scope, receive, send, too_large)
            return
        body = _Body(receive, rule, timeout_s=self.settings.body_timeout_s)
        if rule.buffered:
            await self._buffered(scope, body, send, rule)
        else:
            await self._streamed(scope, body, send)

    async def _buffered(self, scope: Scope, body: _Body, send: Send, rule: BodyRule) -> None:
        try:
            data = await body.read_all()
        except _Disconnected:
            return  # nobody to answer
        except CachekeeperError as exc:
            await _answer(scope, body.next_message, send, exc)
            return
        if rule.json and data:
            reason = screen_json(data)
            if reason is not None:
                await _answer(scope, body.next_message, send, rule.invalid(reason))
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await body.next_message()

        await self.app(scope, replay, send)

    async def _streamed(self, scope: Scope, body: _Body, send: Send) -> None:
        started = False
        replaced = False

        async def guarded_send(message: Message) -> None:
            nonlocal started, replaced
            if replaced:
                return
            if message["type"] == "http.response.start" and body.refusal is not None:
                replaced = True
                await _answer(scope, body.next_message, send, body.refusal)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, body.next_message, guarded_send)
        except Exception:
            if body.refusal is None or started or replaced:
                raise
        if body.refusal is not None and not started and not replaced:
            await _answer(scope, body.next_message, send, body.refusal)
