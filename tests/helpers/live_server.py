"""A real uvicorn server on 127.0.0.1 (an OS-chosen port) in a thread, for tests and benches.

handle = start_server(Settings(data_dir=tmp_path / "data"))
httpx.get(f"{handle.url}/healthz")
handle.stop()

With ``resp_port`` set (0: any free port) the per-key tier's listener starts too, as
``serve`` starts it; ``handle.resp_port`` is its port.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn

from cachekeeper.server.app import create_app
from cachekeeper.server.settings import Settings

__all__ = ["LiveServer", "TOKENS", "start_server"]

# The bearer tokens of the tests' servers with auth on (``authed_server`` in tests/conftest.py).
TOKENS = {"write-token": "write", "read-token": "read"}


@dataclass
class LiveServer:
    """A running server: ``url`` (no trailing slash), ``app``, ``settings``; ``stop()`` it."""

    url: str
    port: int
    app: Any
    settings: Settings
    server: uvicorn.Server
    thread: threading.Thread
    resp_port: int | None = None

    def stop(self, *, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.app.state.resp is not None:
            self.app.state.resp.stop(timeout_s=timeout_s)

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(settings: Settings, *, timeout_s: float = 15.0) -> LiveServer:
    """Build ``create_app(settings)`` and serve it on 127.0.0.1:0 until ``stop()``."""
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=30,
        ssl_certfile=settings.tls_cert,  # https when the settings serve TLS, as `serve` does
        ssl_keyfile=settings.tls_key,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="cachekeeper-live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the live cachekeeper server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    resp_port = None if app.state.resp is None else app.state.resp.start()
    return LiveServer(
        url=f"{settings.scheme}://127.0.0.1:{port}",
        port=port,
        app=app,
        settings=settings,
        server=server,
        thread=thread,
        resp_port=resp_port,
    )
