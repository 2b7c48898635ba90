"""The one client transport (rules in client/calls.py, requests in client/transport.py),
against real HTTP servers on loopback (tests/helpers/slow_servers.py): every path sends
the same headers, and the object store's requests follow CacheClient's retry rule."""

from __future__ import annotations

import socket
import threading

import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.calls import USER_AGENT, Backoff, Deadline
from cachekeeper.client.direct import DirectUnavailable, ObjectStore
from cachekeeper.errors import ServerUnavailable
from tests.helpers.slow_servers import FakeServer, Request, Route, answer_json

DATA = bytes(range(256)) * 40  # 10,240 bytes, 4 parts of 2,560
PART = 2560


def _send(conn: socket.socket, status: int, headers: dict[str, str], body: bytes = b"") -> None:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)


def _range(request: Request) -> tuple[int, int]:
    first, _, last = request.headers["range"].removeprefix("bytes=").partition("-")
    return int(first), min(int(last), len(DATA) - 1)


def ranged(*, cut_first: int = 0, refuse_after: int | None = None) -> Route:
    """Ranged GETs of DATA: the first ``cut_first`` answers to the range at 0 break off
    half-way (the connection closes); with ``refuse_after``, a range starting there or
    later is a 403."""
    cuts = [cut_first]
    lock = threading.Lock()

    def route(conn: socket.socket, request: Request, stop: threading.Event) -> None:
        start, end = _range(request)
        if refuse_after is not None and start >= refuse_after:
            _send(conn, 403, {}, b"<Error><Code>AccessDenied</Code></Error>")
            return
        part = DATA[start : end + 1]
        with lock:
            cut = start == 0 and cuts[0] > 0
            cuts[0] -= cut
        headers = {"Content-Range": f"bytes {start}-{end}/{len(DATA)}"}
        if cut:  # promise the whole part, send half, hang up
            head = f"HTTP/1.1 206 X\r\nContent-Length: {len(part)}\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            conn.sendall(head.encode("latin-1") + b"\r\n" + part[: len(part) // 2])
            return
        _send(conn, 206, headers, part)

    return route


def statuses(*codes: int) -> Route:
    """Answer each of ``codes`` to one request in turn, then 200."""
    left = list(codes)

    def route(conn: socket.socket, request: Request, stop: threading.Event) -> None:
        _send(conn, left.pop(0) if left else 200, {})

    return route


def test_every_client_path_sends_one_user_agent_and_the_token_only_to_the_server() -> None:
    from cachekeeper.client.transport import post_json

    routes = {"/metrics": statuses(), "/v1/reports": answer_json({}), "/obj": statuses()}
    with FakeServer(routes) as server:
        with CacheClient(base_url=server.url, token="s3cret") as client:
            client.metrics()
        assert post_json(server.url, "/v1/reports", {}, token="s3cret", timeout_s=5) is not None
        with ObjectStore() as objects:
            objects.put(
                f"{server.url}/obj?X-Amz-Signature=x",
                open_body=lambda: iter([b"abc"]),
                size_bytes=3,
                headers={},
            )
    seen = {r.path.split("?")[0]: r.headers for r in server.requests}
    assert set(seen) == {"/metrics", "/v1/reports", "/obj"}
    assert {h.get("user-agent") for h in seen.values()} == {USER_AGENT}
    assert seen["/metrics"]["authorization"] == seen["/v1/reports"]["authorization"]
    assert seen["/metrics"]["authorization"] == "Bearer s3cret"
    assert "authorization" not in seen["/obj"]  # the store's URLs carry their own signature


def test_a_presigned_put_answered_5xx_is_sent_again_then_refused_naming_the_status() -> None:
    with FakeServer({"/obj": statuses(503, 502)}) as server, ObjectStore() as objects:
        objects.put(f"{server.url}/obj", open_body=lambda: iter([b"ab"]), size_bytes=2, headers={})
        assert len(server.requests) == 3  # two 5xx, then stored
    with FakeServer({"/obj": statuses(503, 503, 503)}) as server, ObjectStore() as objects:
        with pytest.raises(DirectUnavailable, match=r"PUT http://127\.0\.0\.1:\d+/obj .*HTTP 503"):
            objects.put(
                f"{server.url}/obj?sig=1", open_body=lambda: iter([b"ab"]), size_bytes=2, headers={}
            )
        assert len(server.requests) == 3  # PUT_BACKOFF: two more tries, no more


def test_a_part_cut_off_is_asked_again_the_first_one_too() -> None:
    """Issue 26: the first part had no retry of its own (only later parts had one, in a loop
    of their own), so one connection reset sent the whole download back to the server."""
    with FakeServer({"/obj": ranged(cut_first=1)}) as server, ObjectStore() as objects:
        stream = objects.open_ranged(f"{server.url}/obj", part_bytes=PART, parallel=2)
        try:
            assert stream.read() == DATA
        finally:
            stream.close()
    starts = [_range(r)[0] for r in server.requests]
    assert starts.count(0) == 2 and len(starts) == 5


def test_a_refused_part_is_not_asked_again() -> None:
    """A 403 (an expired URL) stays one: the download falls back to the server at once."""
    with FakeServer({"/obj": ranged(refuse_after=PART)}) as server, ObjectStore() as objects:
        stream = objects.open_ranged(f"{server.url}/obj", part_bytes=PART, parallel=1)
        try:
            with pytest.raises(DirectUnavailable, match="HTTP 403"):
                stream.read()
        finally:
            stream.close()
    starts = [_range(r)[0] for r in server.requests]
    assert starts.count(PART) == 1, starts


def test_past_the_deadline_nothing_is_sent_and_the_store_is_not_blamed() -> None:
    """ServerUnavailable, not DirectUnavailable: falling back to the server is no use then."""
    with FakeServer({"/obj": statuses()}) as server, ObjectStore() as objects:
        with pytest.raises(ServerUnavailable, match="deadline") as caught:
            objects.get_range(f"{server.url}/obj", 0, 9, deadline=Deadline(0.0))
        assert not isinstance(caught.value, DirectUnavailable)
    assert server.requests == []


def test_backoff_gives_up_without_sleeping_when_retries_or_time_are_used_up() -> None:
    rule = Backoff(retries=2, base_s=0.001)
    assert rule.wait(0, Deadline(None)) and rule.wait(1, Deadline(None))
    assert not rule.wait(2, Deadline(None))  # retries used up
    assert not Backoff(base_s=1.0).wait(0, Deadline(0.2))  # a 0.5-1 s wait would pass it
