"""The real server in this process, without a socket: ``create_app(settings)`` behind
httpx's ``ASGITransport``, for unit tests of what the server decides.

    with in_process(Settings(data_dir=tmp_path / "data")) as server:
        server.client.post("/v1/gc", json={"dry_run": True})
        CacheClient(base_url=server.url, transport=server.transport)  # the client too

The app, its routes, middleware, catalog and blob store are the ones ``serve`` runs; only
the network is left out, so a test costs milliseconds instead of a uvicorn start and a
loopback round trip per request. What only a socket shows (cut connections, slow
clients, uvicorn's own limits) stays with ``tests/helpers/live_server.py``.

httpx's ``ASGITransport`` is async; ``InProcessTransport`` is the sync transport the
code under test uses (``httpx.Client``, ``CacheClient``): each request runs to completion
on one private event loop (``asyncio.Runner``), so requests are served one at a time,
in order, and the answer's bytes are read in full before it returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from cachekeeper.server.app import create_app
from cachekeeper.server.settings import Settings

__all__ = ["InProcessServer", "InProcessTransport", "URL", "in_process"]

URL = "http://localhost:8750"  # nothing resolves it; loopback, so a token may go over http


class InProcessTransport(httpx.BaseTransport):
    """A sync httpx transport that hands each request to an ASGI app in this process."""

    def __init__(self, app: Any) -> None:
        self._runner = asyncio.Runner()
        self._asgi = httpx.ASGITransport(app=app, client=("127.0.0.1", 50000))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()  # the body as one ByteStream, which is async-iterable too
        return self._runner.run(self._send(request))

    async def _send(self, request: httpx.Request) -> httpx.Response:
        answer = await self._asgi.handle_async_request(request)
        raw = b"".join([chunk async for chunk in answer.stream])  # type: ignore[union-attr]
        return httpx.Response(
            answer.status_code, headers=answer.headers, stream=httpx.ByteStream(raw)
        )

    def close(self) -> None:
        self._runner.close()


@dataclass(frozen=True)
class InProcessServer:
    """``app`` (``app.state.services``, ``app.state.settings``), ``settings``, and a
    ``client`` (``httpx.Client`` on ``url``) that talks to it through ``transport``."""

    app: Any
    settings: Settings
    transport: InProcessTransport
    client: httpx.Client
    url: str = URL


@contextmanager
def in_process(settings: Settings) -> Iterator[InProcessServer]:
    """A fresh app on ``settings`` and a client for it; both closed at the end."""
    app = create_app(settings)
    transport = InProcessTransport(app)
    client = httpx.Client(base_url=URL, transport=transport, timeout=30)
    try:
        yield InProcessServer(app=app, settings=settings, transport=transport, client=client)
    finally:
        client.close()  # closes the transport, and its event loop
