"""server/connections.py: the header timeout and the connection cap, on a real uvicorn."""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import h11
import httpx
import pytest
import uvicorn
from packaging.requirements import Requirement
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from cachekeeper.errors import ConfigInvalid
from cachekeeper.server.app import create_app
from cachekeeper.server.connections import (
    ACCEPT_BATCH,
    H11_ATTRIBUTES,
    H11_HOOKS,
    MAX_CONNECTIONS,
    RESERVED_FILES,
    bounded_protocol,
    check_h11_protocol,
    connection_budget,
    connection_cap,
)
from cachekeeper.server.settings import Settings

REPO = Path(__file__).resolve().parents[2]

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


def _served(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b"}"):
        chunk = sock.recv(1000)
        if not chunk:
            break
        answer += chunk
    return answer


def test_at_the_cap_an_idle_kept_alive_connection_makes_room(port: int) -> None:
    """uvicorn calls ``on_response_complete`` (a private hook) once a response is sent:
    that is where a kept-alive connection becomes evictable. Were it renamed, every idle
    kept-alive connection would hold its place and a new one at the cap be refused."""
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]
    for sock in idle:
        assert _served(sock).startswith(b"HTTP/1.1 200")  # answered, kept alive, now idle
    assert not _closed(idle[0], 0.2)  # the keep-alive timeout (30 s) has not closed it
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    assert _closed(idle[0], 2.0)  # the oldest idle one made room


def _server_extra_requirement(name: str) -> Requirement:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    for line in pyproject["project"]["optional-dependencies"]["server"]:
        requirement = Requirement(line)
        if requirement.name == name:
            return requirement
    raise AssertionError(f"{name} is not in the server extra")


def test_the_installed_uvicorn_is_one_the_bound_admits() -> None:
    """pyproject.toml bounds uvicorn on both sides (its H11Protocol is private), and the
    tests run on a release inside the bound."""
    specifier = _server_extra_requirement("uvicorn").specifier
    assert any(spec.operator == "<" for spec in specifier), specifier  # an upper bound
    assert specifier.contains(uvicorn.__version__), (uvicorn.__version__, str(specifier))


def test_uvicorns_private_surface_is_what_the_bounded_protocol_relies_on() -> None:
    """Fails loudly when an uvicorn release changes what BoundedH11 uses: each hook it
    overrides is H11Protocol's own (not asyncio.Protocol's empty default) with the
    parameters it passes on, and a real instance has the attributes it reads."""
    for name in H11_HOOKS:
        assert name in vars(H11Protocol), f"uvicorn {uvicorn.__version__}: H11Protocol.{name}"
    params = {
        name: list(inspect.signature(getattr(H11Protocol, name)).parameters)[1:]
        for name in H11_HOOKS
    }
    assert params == {
        "connection_made": ["transport"],
        "data_received": ["data"],
        "on_response_complete": [],
        "connection_lost": ["exc"],
    }
    loop = asyncio.new_event_loop()
    try:
        protocol = bounded_protocol(header_timeout_s=1.0, max_connections=CAP)
        config = uvicorn.Config(_plain_asgi, http=protocol)
        state = ServerState()
        made = protocol(config=config, server_state=state, app_state={}, _loop=loop)
        assert set(H11_ATTRIBUTES) <= set(vars(made))
        assert made.connections is state.connections  # the server's set: the cap counts it
        assert isinstance(made.conn, h11.Connection) and made.conn.their_state is h11.IDLE
        assert made.loop is loop
    finally:
        loop.close()


async def _plain_asgi(scope: object, receive: object, send: object) -> None:
    """An ASGI app for a protocol built outside a server (none of it is called)."""


def test_an_uvicorn_without_a_hook_fails_loudly_at_start() -> None:
    """An uvicorn installed past the bound whose H11Protocol lost a hook: ``serve`` stops
    in one line naming uvicorn's version and the hook, instead of not bounding."""

    class Renamed(asyncio.Protocol):  # on_response_complete renamed, say
        def on_response_done(self) -> None: ...

    check_h11_protocol(H11Protocol)  # the installed one has them all
    with pytest.raises(ConfigInvalid) as caught:
        check_h11_protocol(Renamed)
    assert f"uvicorn {uvicorn.__version__}" in caught.value.detail
    assert "no on_response_complete" in caught.value.detail
    assert ">=0.29,<0.55" in caught.value.detail
