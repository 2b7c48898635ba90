"""Every auth case: no token 401, unknown token 401, wrong scope 403, right scope ok,
anonymous read on and off, and tokens never shown in the settings' repr."""

from __future__ import annotations

import hashlib
import socket

import httpx
import pytest

from cachekeeper.server.settings import Settings, load_settings, parse_tokens

TOKENS = {"r-tok": "read", "w-tok": "write", "a-tok": "admin"}
BLOB = b"auth blob"
DIGEST = hashlib.sha256(BLOB).hexdigest()

# (method, path, body, needed scope)
ROUTES = [
    ("POST", "/v1/blobs/missing", {"digests": []}, "read"),
    ("GET", "/v1/snapshots", None, "read"),
    ("GET", "/v1/workloads", None, "read"),
    ("PUT", f"/v1/blobs/{DIGEST}", BLOB, "write"),
    ("POST", "/v1/gc", {"dry_run": True}, "admin"),
]
RANK = {"read": 0, "write": 1, "admin": 2}


def _call(
    c: httpx.Client, method: str, path: str, body: object, token: str | None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if isinstance(body, bytes):
        return c.request(method, path, content=body, headers=headers)
    return c.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("anonymous_read", [False, True])
def test_scopes(fresh_server, anonymous_read: bool) -> None:  # type: ignore[no-untyped-def]
    live = fresh_server(tokens=TOKENS, anonymous_read=anonymous_read)
    with httpx.Client(base_url=live.url) as c:
        for method, path, body, needed in ROUTES:
            anon = _call(c, method, path, body, None)
            if needed == "read" and anonymous_read:
                assert anon.status_code == 200, (path, anon.text)
            else:
                assert anon.status_code == 401, (path, anon.text)
                assert anon.json()["error"] == "unauthorized"
            bogus = _call(c, method, path, body, "not-a-token")
            assert bogus.status_code == 401 and bogus.json()["error"] == "unauthorized"
            for token, scope in TOKENS.items():
                r = _call(c, method, path, body, token)
                if RANK[scope] >= RANK[needed]:
                    assert r.status_code in (200, 201), (path, scope, r.text)
                else:
                    assert r.status_code == 403, (path, scope, r.text)
                    assert r.json()["error"] == "forbidden"
        # health stays open for probes; metrics (workload names in labels) need read
        assert c.get("/healthz").status_code == 200
        assert c.get("/metrics").status_code == (200 if anonymous_read else 401)
        read = [t for t, scope in TOKENS.items() if scope == "read"][0]
        assert c.get("/metrics", headers={"Authorization": f"Bearer {read}"}).status_code == 200
        # a malformed header is a 401, not a crash
        r = c.get("/v1/snapshots", headers={"Authorization": "Basic abc"})
        assert r.status_code == 401


def test_no_tokens_means_open(fresh_server) -> None:  # type: ignore[no-untyped-def]
    live = fresh_server()
    with httpx.Client(base_url=live.url) as c:
        assert c.post("/v1/gc", json={"dry_run": True}).status_code == 200


def test_token_parsing_and_repr(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert parse_tokens("a:read, b:admin") == {"a": "read", "b": "admin"}
    assert parse_tokens('{"a": "write"}') == {"a": "write"}
    with pytest.raises(ValueError, match="scope"):
        parse_tokens("a:root")
    monkeypatch.setenv("CACHEKEEPER_TOKENS", "sekrit-token:admin")
    monkeypatch.setenv("CACHEKEEPER_MAX_FILES", "7")
    config = tmp_path / "server.toml"
    config.write_text('max_files = 3\nmax_blob_bytes = 99\n[tokens]\n"file-tok" = "read"\n')
    settings = load_settings(config_file=config, port=9999, host=None)
    assert settings.tokens == {"sekrit-token": "admin"}  # env beats the file
    assert settings.max_files == 7 and settings.max_blob_bytes == 99 and settings.port == 9999
    assert "sekrit" not in repr(settings) and "sekrit" not in str(settings)
    monkeypatch.delenv("CACHEKEEPER_TOKENS")
    monkeypatch.setenv("CACHEKEEPER_HOME", str(tmp_path / "home"))
    assert Settings().data_dir == tmp_path / "home" / "server"


def test_metrics_are_public_only_when_the_operator_says_so(fresh_server) -> None:  # type: ignore[no-untyped-def]
    """Issue 25: /metrics answered anyone, and its labels name the workloads."""
    live = fresh_server(tokens=TOKENS, metrics_public=True)
    assert httpx.get(f"{live.url}/metrics").status_code == 200
    assert httpx.get(f"{live.url}/v1/snapshots").status_code == 401  # only metrics opened


def _raw_request(port: int, head: str) -> bytes:
    """Send a request's head announcing a body, never the body; what the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head.encode())
        answer = b""
        try:
            while chunk := sock.recv(4096):  # the refusal closes the connection
                answer += chunk
        except TimeoutError:
            pass  # the server is waiting for the body: it would read it
        return answer


@pytest.mark.parametrize(
    ("path", "token", "status"),
    [
        ("/v1/resolve", None, b"401"),  # read route, anonymous read off
        ("/v1/resolve", "nobody-knows-me", b"401"),
        ("/v1/gc", "r-tok", b"403"),  # admin route, read token
        ("/v1/workloads/big", "r-tok", b"403"),  # registering a workload: write
    ],
)
def test_a_caller_without_a_good_token_is_refused_before_its_body_is_read(
    fresh_server, path: str, token: str | None, status: bytes
) -> None:  # type: ignore[no-untyped-def]
    # 16 MB announced and none sent: a server that reads bodies before auth waits for it
    # (the body timeout is 30 s, the socket gives up after 5 s) and answers nothing.
    live = fresh_server(tokens=TOKENS, anonymous_read=False)
    method = "PUT" if path.startswith("/v1/workloads/") else "POST"
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {(16 << 20) - 1}\r\n\r\n"
    )
    answer = _raw_request(live.port, head)
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1:2] == [status], answer[:200]
    assert b"scope" in answer  # the same answer as the route's own: it names the scope


def test_a_good_token_still_sends_its_body(fresh_server) -> None:  # type: ignore[no-untyped-def]
    live = fresh_server(tokens=TOKENS, anonymous_read=False)
    with httpx.Client(base_url=live.url) as c:
        r = c.post("/v1/gc", json={"dry_run": True}, headers={"Authorization": "Bearer a-tok"})
    assert r.status_code == 200, r.text


def test_a_report_without_a_token_is_refused_before_its_body_with_anonymous_read(
    fresh_server,
) -> None:  # type: ignore[no-untyped-def]
    """anonymous_read opens the read routes, not reports (they are attributed to a token):
    the refusal comes from the headers, as for any route a caller may not use."""
    live = fresh_server(tokens=TOKENS, anonymous_read=True)
    head = (
        "POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {(16 << 20) - 1}\r\n\r\n"
    )
    answer = _raw_request(live.port, head)
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1:2] == [b"401"], answer[:200]
    assert b"attributed to the token" in answer
