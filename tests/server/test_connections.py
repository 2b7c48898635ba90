"""server/connections.py: the header timeout and the connection cap, on a real uvicorn."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from cachekeeper.server.app import create_app
from cachekeeper.server.connections import (
    ACCEPT_BATCH,
    MAX_CONNECTIONS,
    RESERVED_FILES,
    bounded_protocol,
    connection_budget,
    connection_cap,
)
from cachekeeper.server.settings import Settings

CAP = 20


@pytest.fixture
def port(tmp_path: Path) -> Iterator[int]:
    app = create_app(Settings(data_dir=tmp_path / "data"))
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=30,
        http=bounded_protocol(header_timeout_s=1.0, max_connections=CAP),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _closed(sock: socket.socket, wait_s: float) -> bool:
    sock.settimeout(wait_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_a_kept_alive_connections_next_headers_are_bounded_too(port: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b"}"):  # the whole answer: its JSON body ends the response
        answer += sock.recv(1000)
    assert answer.startswith(b"HTTP/1.1 200")
    sock.sendall(b"G")  # the next request starts, and stalls
    started = time.monotonic()
    assert _closed(sock, 5.0)
    assert 0.8 < time.monotonic() - started < 3.0


def test_at_the_cap_the_oldest_waiting_connection_makes_room(port: int) -> None:
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP + 5)]
    for sock in slow:
        sock.sendall(b"G")
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    assert _closed(slow[0], 0.5)  # the oldest went first
    open_now = sum(not _closed(s, 0.01) for s in slow)
    assert open_now <= CAP


def test_the_default_cap_stays_under_the_open_file_limit(tmp_path: Path) -> None:
    """The cap and the accept backlog (asyncio accepts that many before any cap is looked
    at) fit in the open-file limit less the server's own files."""
    settings = Settings(data_dir=tmp_path)
    small = connection_budget(settings, open_files=1024)
    assert small.http + small.backlog == 1024 - RESERVED_FILES and small.backlog >= 64
    assert connection_cap(settings, open_files=1024) == small.http
    assert connection_cap(settings, open_files=1 << 20) == MAX_CONNECTIONS
    assert connection_budget(settings, open_files=1 << 20).backlog == ACCEPT_BATCH
    capped = Settings(data_dir=tmp_path, max_connections=100_000)
    assert connection_cap(capped, open_files=1024) == small.http


def test_with_the_tier_one_budget_is_split_between_http_and_resp(tmp_path: Path) -> None:
    """Both listeners' caps and backlogs fit in one budget, each with its own share; two
    settings that together ask for too much are each scaled down to their part."""
    tier = Settings(data_dir=tmp_path, resp_port=0)
    split = connection_budget(tier, open_files=1024)
    assert split.http == split.resp
    assert split.http + split.resp + 2 * split.backlog <= 1024 - RESERVED_FILES
    big = connection_budget(tier, open_files=1 << 20)
    assert big.http == big.resp == MAX_CONNECTIONS and big.backlog == ACCEPT_BATCH
    asked = Settings(
        data_dir=tmp_path, resp_port=0, max_connections=600, remote_cache_max_connections=200
    )
    scaled = connection_budget(asked, open_files=1024)
    assert scaled.http + scaled.resp + 2 * scaled.backlog <= 1024 - RESERVED_FILES
    assert scaled.http == 3 * scaled.resp  # in proportion
    fits = Settings(
        data_dir=tmp_path, resp_port=0, max_connections=100, remote_cache_max_connections=50
    )
    kept = connection_budget(fits, open_files=1024)
    assert (kept.http, kept.resp) == (100, 50)
