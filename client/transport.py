"""Every request of the client side, sent under the rules of ``client/calls.py``.

``CacheClient`` (the server's API) and ``ObjectStore`` (presigned URLs) are two users of
one httpx transport, and the pre-job hook's few requests are one stdlib function:

- ``http_client()`` makes their httpx client: the User-Agent once (and the bearer token,
  for the server only), the one TLS context, no redirects followed.
- ``send()`` is the one request loop. Each try waits at most what the deadline leaves; a
  failure on the way (refused, reset, timed out) and an answer in ``RETRY_STATUSES`` are
  tried again under the caller's ``Backoff``; the answer is read inside the try, so a
  connection cut mid-answer is retried too. A try that never got an answer raises
  ``ServerUnavailable`` (or the caller's subclass of it: the object store's
  ``DirectUnavailable``) naming the request, from httpx's error: httpx's exceptions are
  wrapped here and nowhere else.
- ``read_answer()`` reads an answer whole, against the deadline and a size cap;
  ``StreamReader`` is a streamed answer as a file (the archive download), mapping a
  connection cut mid-stream to ``ServerUnavailable``.
- ``post_json()`` is the hook's quick resolve and the job reports: one plain
  ``http.client`` POST, never an exception. Its time bound is a wall-clock bound on the
  whole request, not a socket timeout (which bounds each read alone, so a server trickling
  a byte a second would never trip it): the request runs in a daemon thread that the caller
  stops waiting for at the bound, and the socket is shut down then, so the thread ends too.
  Name resolution, connecting, sending and reading all count. The answer is read up to
  ``RESOLVE_MAX_BYTES``; a longer one is trouble.

httpx is imported on first use (``import_httpx``), without its command-line module (click,
rich, pygments: ~100 ms); this module itself is stdlib only, so the pre-job hook's no-op
path, which sends only ``post_json``, loads no httpx.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from cachekeeper.errors import CachekeeperError, ServerError, ServerUnavailable

from .calls import (
    RESOLVE_MAX_BYTES,
    RETRY_STATUSES,
    Backoff,
    Deadline,
    endpoint,
    plaintext_allowed,
    read_within,
    redact_url,
    refuse_plaintext,
    request_headers,
    tls_context,
    tls_hint,
)

if TYPE_CHECKING:
    import httpx

__all__ = [
    "StreamReader",
    "describe",
    "http_client",
    "import_httpx",
    "post_json",
    "read_answer",
    "send",
]

_T = TypeVar("_T")
_STREAM_CHUNK_BYTES = 1 << 20


def import_httpx() -> Any:
    """Import httpx without ``httpx._main`` (its CLI: click + rich + pygments, ~100 ms)."""
    if "httpx" in sys.modules:
        return sys.modules["httpx"]
    blocked = "httpx._main" not in sys.modules
    if blocked:
        sys.modules["httpx._main"] = None  # type: ignore[assignment]  # httpx falls back to a stub
    try:
        import httpx
    finally:
        if blocked and sys.modules.get("httpx._main") is None:
            del sys.modules["httpx._main"]
    return httpx


def http_client(
    *,
    timeout_s: float,
    base_url: str | None = None,
    token: str | None = None,
    transport: httpx.BaseTransport | None = None,
    max_connections: int | None = None,
    allow_plaintext: bool | None = None,
) -> httpx.Client:
    """An httpx client under the rules: ``base_url`` is the one server it talks to (with
    ``token``); None, presigned URLs on any host. ``transport`` is the test seam.

    A token for an ``http://`` server that is not loopback is ``PlaintextRefused`` here,
    before any request (``calls.refuse_plaintext``; ``allow_plaintext`` None: the setting).
    """
    if base_url is not None:
        allow = plaintext_allowed() if allow_plaintext is None else allow_plaintext
        refuse_plaintext(base_url, token=token, allow=allow)
    httpx = import_httpx()
    # A client for one plain-http server needs no TLS context; building one loads the CA
    # bundle (~100 ms). Presigned URLs may be https whatever the server is.
    https = base_url is None or base_url.lower().startswith("https://")
    options: dict[str, Any] = {}
    if max_connections is not None:
        options["limits"] = httpx.Limits(max_connections=max_connections)
    return httpx.Client(
        base_url=base_url or "",
        headers=request_headers(token=token),
        transport=transport,
        verify=tls_context() if https else False,
        follow_redirects=False,
        timeout=timeout_s,
        **options,
    )


def send(
    http: httpx.Client,
    method: str,
    url: str,
    *,
    what: str,
    read: Callable[[httpx.Response], _T],
    deadline: Deadline,
    backoff: Backoff,
    timeout_s: float,
    json_body: Any = None,
    open_body: Callable[[], Any] | None = None,
    headers: Mapping[str, str] | None = None,
    unavailable: type[ServerUnavailable] = ServerUnavailable,
) -> _T:
    """``read(answer)`` of one request, under the one retry rule (see the module docstring).

    ``what`` names the request in messages (``"GET http://cache:8750/healthz"``: no
    password, no signature). ``open_body`` makes the body anew for each try (a file or an
    iterator of bytes; closed after the try). ``read`` gets the answer as a stream and
    reads it (a connection cut while it reads is retried), or returns it open to be
    streamed by the caller; the answer it gets is a success, one the rule does not retry,
    or the last retryable one. Past the deadline nothing more is sent:
    ``ServerUnavailable`` (never ``unavailable``: no other source is in time either).
    """
    httpx = import_httpx()
    retry = 0
    while True:
        try:
            timeout = deadline.bound(timeout_s)
        except ServerUnavailable as exc:
            raise ServerUnavailable(f"{what}: {exc.detail}") from None
        body = open_body() if open_body is not None else None
        try:
            request = http.build_request(
                method,
                url,
                json=json_body,
                content=body,
                headers=headers,
                timeout=httpx.Timeout(timeout),
            )
            response = http.send(request, stream=True)
            if response.status_code in RETRY_STATUSES and backoff.wait(retry, deadline):
                response.close()
                retry += 1
                continue
            try:
                return read(response)
            except BaseException:
                response.close()
                raise
        except httpx.TransportError as exc:
            if backoff.wait(retry, deadline):
                retry += 1
                continue
            text = describe(exc)
            hint = tls_hint(
                str(http.base_url.join(url)), text, timeout_s=min(2.0, deadline.remaining() or 2.0)
            )
            raise unavailable(f"{what} failed: {text}{hint}") from exc
        finally:
            if body is not None and hasattr(body, "close"):
                body.close()


def read_answer(
    response: httpx.Response,
    *,
    limit: int,
    deadline: Deadline,
    what: str,
    unavailable: type[ServerUnavailable] = ServerUnavailable,
    too_long: type[CachekeeperError] = ServerError,
) -> httpx.Response:
    """``response`` read whole, as a new (closed) response: ``unavailable`` once the
    deadline passes, ``too_long`` past ``limit`` bytes. TransportErrors pass through (for
    ``send`` to retry)."""
    httpx = import_httpx()
    try:
        data = read_within(
            response.iter_bytes(),
            limit=limit,
            deadline=deadline,
            late=lambda n: unavailable(
                f"{what}: the answer passed the {deadline.seconds:g} s deadline ({n} bytes in)"
            ),
            over=lambda: too_long(f"{what}: the answer is over {limit} bytes; refused"),
        )
    finally:
        response.close()
    # The bytes are decoded already: the new response must not decode them again.
    kept = [
        (k, v)
        for k, v in response.headers.multi_items()
        if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")
    ]
    return httpx.Response(
        response.status_code, headers=kept, content=data, request=response.request
    )


class StreamReader(io.RawIOBase):
    """A streamed answer's body as a readable file: read as it arrives, never past the
    deadline; a connection cut mid-stream is ``ServerUnavailable``."""

    def __init__(self, response: httpx.Response, deadline: Deadline | None) -> None:
        self._chunks = response.iter_raw(_STREAM_CHUNK_BYTES)
        self._url = redact_url(str(response.request.url))
        self._deadline = deadline
        self._pending = memoryview(b"")  # a view, so handing out a chunk copies it once
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        httpx = import_httpx()
        while not self._pending and not self._done:
            if self._deadline is not None and self._deadline.expired:
                raise ServerUnavailable(
                    f"download of {self._url} passed the {self._deadline.seconds:g} s deadline"
                )
            try:
                self._pending = memoryview(next(self._chunks))
            except StopIteration:
                self._done = True
            except httpx.TransportError as exc:
                raise ServerUnavailable(
                    f"download of {self._url} was cut off: {describe(exc)}"
                ) from exc
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def describe(exc: Exception) -> str:
    """A transport failure in a few words: its class and its message, once each."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def post_json(
    server: str | None,
    path: str,
    body: dict[str, Any],
    *,
    token: str | None,
    timeout_s: float,
    allow_plaintext: bool | None = None,
) -> tuple[int, bytes] | None:
    """POST ``body`` as JSON to route ``path`` of ``server`` (``calls.endpoint``): (status,
    body), or None on any trouble, including not being done within ``timeout_s`` in all (see
    the module docstring). No retry: the hook's budget has no room for one, and the callers
    fall back (prejob to ``CacheClient``, which retries; a report is best-effort).

    A token that would go in clear text to a host that is not loopback is never sent
    (``calls.refuse_plaintext``; ``allow_plaintext`` None: the setting): None, nothing sent.
    """
    if not server or timeout_s <= 0:
        return None
    allow = plaintext_allowed() if allow_plaintext is None else allow_plaintext
    try:
        refuse_plaintext(server, token=token, allow=allow)
    except CachekeeperError:
        return None
    found: list[tuple[int, bytes] | None] = [None]
    cut = threading.Event()
    socks: list[socket.socket] = []

    def run() -> None:
        found[0] = _post(server, path, body, token=token, timeout_s=timeout_s, socks=socks, cut=cut)

    worker = threading.Thread(target=run, name="cachekeeper-post", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        cut.set()
        for sock in socks:  # a blocked read returns at once: the thread ends soon after
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return None
    return found[0]


def _post(
    server: str,
    path: str,
    body: dict[str, Any],
    *,
    token: str | None,
    timeout_s: float,
    socks: list[socket.socket],
    cut: threading.Event,
) -> tuple[int, bytes] | None:
    import http.client  # only with a server set: the hook's start-up budget

    try:
        url = urlsplit(endpoint(server, path))
        if url.scheme == "http":
            conn: http.client.HTTPConnection = http.client.HTTPConnection(
                url.hostname or "", url.port, timeout=timeout_s
            )
        elif url.scheme == "https":
            conn = http.client.HTTPSConnection(
                url.hostname or "", url.port, timeout=timeout_s, context=tls_context()
            )
        else:
            return None
    except (ValueError, CachekeeperError):  # a bad URL, or a CA bundle that cannot be read
        return None
    headers = {**request_headers(token=token), "Content-Type": "application/json"}
    try:
        conn.connect()
        if conn.sock is not None:
            socks.append(conn.sock)
        if cut.is_set():  # connected after the caller gave up: nobody waits for the answer
            return None
        conn.request("POST", url.path, json.dumps(body).encode(), headers)
        response = conn.getresponse()
        data = response.read(RESOLVE_MAX_BYTES + 1)
        if len(data) > RESOLVE_MAX_BYTES:
            return None
        return response.status, data
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()
