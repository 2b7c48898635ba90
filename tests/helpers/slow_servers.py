"""Real misbehaving HTTP servers on loopback, for the hook's fault and deadline tests.

    server = FakeServer({"/v1/resolve": answer_json({...}), "/v1/reports": dribble()})
    server.url            # http://127.0.0.1:<port>
    server.close()        # stops every handler (a dribbling one too)

Each route is a function ``(conn, request, stop)`` that writes whatever bytes it likes to
the socket, at whatever pace: an answer trickled one byte a second, a stall, a body of
gigabytes, a range server whose later ranges dribble. Nothing here is a mock: the client
under test talks TCP to it. Routes match by the longest path prefix; an unknown path is
a 404. ``server.requests`` lists what came, in order.

In front of a real server (tests/helpers/live_server.py), ``forward(url)`` relays a
route's requests to it byte for byte, so the real server answers every route a test
does not break, and ``forward(url, cut_after_bytes=N)`` drops the connection N bytes
into the real answer (a network that fails mid-download):

    proxy = FakeServer({"/": forward(live.url)})
    proxy.routes["/v1/resolve"] = stall()   # from now on, resolve hangs; the rest is real
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FakeServer",
    "Request",
    "answer",
    "answer_json",
    "dribble",
    "forward",
    "huge_json",
    "ranges",
    "stall",
]


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Route = Callable[[socket.socket, Request, threading.Event], None]


def _read_request(conn: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
        if len(data) > 1 << 20:
            return None
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or 0)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        rest += chunk
    return Request(method, path, headers, rest[:length])


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def answer(body: bytes, *, status: int = 200, content_type: str = "application/json") -> Route:
    """Answer ``body`` as it is, at once (garbage, a proxy's HTML error page, ...)."""

    def route(conn: socket.socket, request: Request, stop: threading.Event) -> None:
        headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
        conn.sendall(_head(status, headers) + body)

    return route


def answer_json(value: Any, *, status: int = 200) -> Route:
    """Answer ``value`` as JSON at once."""
    return answer(json.dumps(value).encode(), status=status)


def forward(url: str, *, cut_after_bytes: int | None = None) -> Route:
    """Relay the request to the server at ``url`` (``http://127.0.0.1:PORT``) and its
    answer back, byte for byte; with ``cut_after_bytes``, shut the connection down after
    that many bytes of the answer (status line and headers included)."""
    host, _, port = url.removeprefix("http://").partition(":")

    def route(conn: socket.socket, request: Request, stop: threading.Event) -> None:
        headers = {k: v for k, v in request.headers.items() if k not in ("connection", "host")}
        headers.update({"host": f"{host}:{port}", "connection": "close"})
        lines = [f"{request.method} {request.path} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        with socket.create_connection((host, int(port)), timeout=60) as upstream:
            upstream.sendall(head + request.body)
            left = cut_after_bytes
            while left is None or left > 0:
                chunk = upstream.recv(65536 if left is None else min(65536, left))
                if not chunk:
                    return
                conn.sendall(chunk)
                if left is not None:
                    left -= len(chunk)
        conn.shutdown(socket.SHUT_RDWR)  # cut off: the client sees the stream end early

    return route


def dribble(*, every_s: float = 1.0, status: int = 200, headers_too: bool = False) -> Route:
    """Send one byte every ``every_s`` seconds, forever: the body (promising a megabyte of
    JSON), or with ``headers_too`` the status line and headers themselves."""

    def route(conn: socket.socket, request: Request, stop: threading.Event) -> None:
        head = _head(status, {"Content-Type": "application/json", "Content-Length": "1000000"})
        if not headers_too:
            conn.sendall(head)
            head = b'{"' + b" " * 1_000_000
        for i in range(len(head)):
            if stop.wait(every_s):
                return
            conn.sendall(head[i : i + 1])

    return route


def stall() -> Route:
    """Read the request, then send nothing until the server closes."""

    def route(conn: socket.socket, request: Request, stop: threading.Event) -> None:
        stop.wait()

    return route


def huge_json(*, size_bytes: int) -> Route:
    """A 200 whose JSON body is ``size_bytes`` long (a string of spaces), sent at full speed."""

    def route(conn: socket.socket, request: Request, stop: threading.Event) -> None:
        conn.sendall(
            _head(200, {"Content-Type": "application/json", "Content-Length": str(size_bytes)})
        )
        chunk = b" " * (1 << 20)
        left = size_bytes
        while left > 0 and not stop.is_set():
            piece = chunk[: min(left, len(chunk))]
            conn.sendall(piece)
            left -= len(piece)

    return route


_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


def ranges(data: bytes, *, fast_until: int, every_s: float = 1.0) -> Route:
    """A presigned-GET stand-in: ranged GETs of ``data``; a range starting before
    ``fast_until`` is answered at once, a later one dribbles a byte every ``every_s``."""

    def route(conn: socket.socket, request: Request, stop: threading.Event) -> None:
        found = _RANGE.fullmatch(request.headers.get("range", ""))
        start, end = (int(found.group(1)), int(found.group(2))) if found else (0, len(data) - 1)
        end = min(end, len(data) - 1)
        part = data[start : end + 1]
        headers = {
            "Content-Length": str(len(part)),
            "Content-Range": f"bytes {start}-{end}/{len(data)}",
        }
        conn.sendall(_head(206, headers))
        if start < fast_until:
            conn.sendall(part)
            return
        for i in range(len(part)):
            if stop.wait(every_s):
                return
            conn.sendall(part[i : i + 1])

    return route


class FakeServer:
    """A threaded TCP server answering each connection's first request by its route
    (``host``: the address it binds, loopback unless a test needs another)."""

    def __init__(self, routes: dict[str, Route], *, host: str = "127.0.0.1") -> None:
        self.routes = routes
        self.stop = threading.Event()
        self.requests: list[Request] = []
        self.connections = 0  # accepted, whether or not a request followed
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = _read_request(conn)
                if request is None:
                    return
                self.requests.append(request)
                matching = [p for p in self.routes if request.path.startswith(p)]
                route = self.routes[max(matching, key=len)] if matching else None
                if route is None:
                    conn.sendall(_head(404, {"Content-Length": "0"}))
                    return
                route(conn, request, self.stop)
            except OSError:
                return  # the client went away

    def close(self) -> None:
        self.stop.set()
        self._sock.close()
        self._thread.join(5)

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
