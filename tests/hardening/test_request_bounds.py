"""Requests bounded in size, time and shape, and a store cap kept against real bytes (issue 18.3,
18.4).

Every test talks to a real uvicorn server on loopback; stalled and lying uploads are raw
sockets that send headers and a few bytes, then nothing. No timing is asserted: the
timeouts below are hang guards, generous next to what the behaviour needs.
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cachekeeper.server.settings import Settings
from tests.helpers.live_server import LiveServer, start_server
from tests.server.conftest import FINGERPRINT, make_snapshot, push

HANG_GUARD_S = 30.0


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    started: list[LiveServer] = []

    def make(**options: object) -> LiveServer:
        options.setdefault("data_dir", tmp_path / f"data{len(started)}")
        handle = start_server(Settings(**options))  # type: ignore[arg-type]
        started.append(handle)
        return handle

    yield make
    for handle in started:
        handle.stop()


def _open(port: int, head: str, body: bytes = b"") -> socket.socket:
    """A raw connection that sent ``head`` (request line + headers) and ``body``, then waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)
    sock.sendall(head.encode() + b"\r\n" + body)
    return sock


def _put_head(digest: str, length: int | None) -> str:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"PUT /v1/blobs/{digest} HTTP/1.1\r\nHost: t\r\n{framing}\r\n"


def _response(sock: socket.socket) -> tuple[int, dict[str, object], bool]:
    """(status, JSON body, closed by the server after it) of the answer on ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed without an answer: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = {
        k.strip().lower(): v.strip()
        for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
    }
    length = int(headers.get(b"content-length", b"0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    try:
        closed = sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        closed = True
    return status, json.loads(rest[:length] or b"{}"), closed


def _tmp_files(live: LiveServer) -> list[Path]:
    tmp = live.settings.data_dir / "blobs" / ".tmp"
    return list(tmp.iterdir()) if tmp.is_dir() else []


def _stored(live: LiveServer) -> set[str]:
    return {p.name[:-4] for p in (live.settings.data_dir / "blobs").glob("??/??/*.zst")}


def _snapshot_ids(c: httpx.Client) -> set[str]:
    return {s["id"] for s in c.get("/v1/snapshots").json()["snapshots"]}


def _wait(condition, *, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.02)


# -- 18.3: the store cap counts real bytes; an upload never evicts -----------------------


def test_an_uploads_claim_never_evicts_and_its_real_bytes_are_capped(serve, reliability) -> None:  # type: ignore[no-untyped-def]
    live = serve(max_store_bytes=5_000_000, gc_grace_s=0)
    rng = random.Random(18)
    with httpx.Client(base_url=live.url, timeout=HANG_GUARD_S) as c:
        kept = []
        for i in range(2):
            manifest, blobs = make_snapshot({f"s{i}.bin": rng.randbytes(1_000_000)}, workload="w")
            assert push(c, manifest, blobs).status_code == 201
            kept.append(manifest)
        before = _stored(live)

        # A claim of 6 MB with a 1-byte body: refused on the claim, nothing evicted.
        liar = _open(live.port, _put_head("ab" * 32, 6_000_000), b"x")
        status, body, _ = _response(liar)
        liar.close()
        assert status == 507 and body["error"] == "insufficient_storage", body
        # A claim that fits, then the client goes away: nothing evicted, nothing stored.
        quitter = _open(live.port, _put_head("cd" * 32, 2_000_000), b"y")
        quitter.close()
        # A chunked upload declares nothing: its real bytes are counted, cut off at the cap.
        big = rng.randbytes(8_000_000)
        digest = hashlib.sha256(big).hexdigest()

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(big), 256 << 10):
                yield big[start : start + (256 << 10)]

        r = c.put(f"/v1/blobs/{digest}", content=chunks())
        assert r.status_code == 507 and r.json()["error"] == "insufficient_storage", r.text
        assert "GC" in r.json()["detail"]

        _wait(lambda: not _tmp_files(live), what="upload temp files removed")
        assert _snapshot_ids(c) == {m.id for m in kept}  # nothing was evicted
        assert _stored(live) == before  # nothing half-written, nothing new
        for manifest in kept:
            assert c.get(f"/v1/snapshots/{manifest.id}/archive").status_code == 200
        # What fits still goes in; an admin's GC is what evicts.
        small = rng.randbytes(100_000)
        assert c.put(f"/v1/blobs/{hashlib.sha256(small).hexdigest()}", content=small).is_success
    reliability.record(
        "blob PUT declaring Content-Length 6 MB with a 1-byte body, 5 MB store cap:"
        " 507, no snapshot evicted",
        tries=2,
        outcome="refused",
        area="bounded requests",
    )
    reliability.record(
        "chunked 8 MB blob upload past a 5 MB store cap: 507 at the cap, no temp file or blob left",
        tries=1,
        outcome="refused",
        area="bounded requests",
    )


# -- 18.4: stalled bodies, body limits, JSON depth and non-finite numbers -------------------


def test_health_resolve_and_archive_answer_while_100_uploads_stall(serve, reliability) -> None:  # type: ignore[no-untyped-def]
    live = serve(body_timeout_s=600)  # the stalls stay open for the whole test
    with httpx.Client(base_url=live.url, timeout=HANG_GUARD_S) as c:
        manifest, blobs = make_snapshot({"a.bin": b"a" * 50_000, "b.bin": b"b" * 70_000})
        assert push(c, manifest, blobs).status_code == 201
        stalled = [
            _open(live.port, _put_head(f"{i:064x}", 1_000_000), b"0123456789") for i in range(100)
        ]
        try:
            # The uploads reached the blob store (each holds a temp file) before we probe.
            workers = min(live.settings.upload_workers, len(stalled))
            _wait(lambda: len(_tmp_files(live)) >= workers, what="stalled uploads in the store")
            latencies = []
            for _ in range(20):
                started = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                latencies.append(time.perf_counter() - started)
            assert c.get("/v1/snapshots").status_code == 200
            r = c.post("/v1/resolve", json={"fingerprint": FINGERPRINT, "workload": "wl"})
            assert r.status_code == 200 and r.json()["snapshot"]["id"] == manifest.id
            assert c.get(f"/v1/snapshots/{manifest.id}/archive").status_code == 200
            for sock in stalled:  # still held open: the server answered around them
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(1)
        finally:
            for sock in stalled:
                sock.close()
        _wait(lambda: not _tmp_files(live), what="abandoned uploads cleaned up")
        assert c.get("/healthz").status_code == 200
    reliability.record(
        "100 blob uploads that send headers and 10 bytes, then stall: /healthz, list, resolve"
        f" and archive still answer (slowest /healthz {max(latencies) * 1000:.0f} ms)",
        tries=100,
        outcome="kept",
        area="bounded requests",
    )


def test_a_stalled_body_is_cut_off_after_the_body_timeout(serve, reliability) -> None:  # type: ignore[no-untyped-def]
    live = serve(body_timeout_s=1)
    digest = "ef" * 32
    heads = [
        _put_head(digest, 1000),
        "POST /v1/snapshots HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n",
        "POST /v1/resolve HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n",
    ]
    for head in heads:
        sock = _open(live.port, head, b'5\r\n{"a":' if "chunked" in head else b"0123456789")
        status, body, closed = _response(sock)
        sock.close()
        assert status == 408 and body["error"] == "request_timeout", (head, body)
        assert closed, head
    _wait(lambda: not _tmp_files(live), what="the cut-off upload's temp file removed")
    assert digest not in _stored(live)
    with httpx.Client(base_url=live.url, timeout=HANG_GUARD_S) as c:
        data = b"after the stall"
        assert c.put(f"/v1/blobs/{hashlib.sha256(data).hexdigest()}", content=data).is_success
    reliability.record(
        "upload, publish and resolve bodies that stall mid-body: 408 after body_timeout_s,"
        " connection closed, no temp file left",
        tries=len(heads),
        outcome="refused",
        area="bounded requests",
    )


def _body_routes(live: LiveServer) -> list[tuple[str, str]]:
    schema = httpx.get(f"{live.url}/openapi.json").json()
    filled = {
        "{digest}": "ab" * 32,
        "{snapshot_id}": "cd" * 32,
        "{name}": "wl",
        "{agent_id}": "agent-1",
        "{key}": "pt2:fx-graph-v1::k:c1",
    }
    routes = []
    for path, methods in schema["paths"].items():
        for method in methods:
            if method.upper() in ("POST", "PUT", "PATCH", "DELETE"):
                for key, value in filled.items():
                    path = path.replace(key, value)
                assert "{" not in path, path
                routes.append((method.upper(), path))
    return routes


def test_every_route_has_a_body_limit(serve, reliability) -> None:  # type: ignore[no-untyped-def]
    limit = 64 << 10
    live = serve(
        max_json_bytes=limit,
        max_manifest_bytes=limit,
        max_workload_bytes=limit,
        max_blob_bytes=limit,
        remote_cache_max_value_bytes=limit,
    )
    routes = _body_routes(live)
    assert len(routes) >= 8
    oversized = b'{"pad": "' + b"x" * (3 << 20) + b'"}'

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(oversized), 64 << 10):
            yield oversized[start : start + (64 << 10)]

    with httpx.Client(base_url=live.url, timeout=HANG_GUARD_S) as c:
        for method, path in routes:
            # 300 MB declared: refused before a byte is read.
            sock = _open(
                live.port, f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 300000000\r\n"
            )
            status, body, _ = _response(sock)
            sock.close()
            assert status == 413 and body["error"] == "payload_too_large", (method, path, body)
            # Chunked (nothing declared): cut off at the limit.
            try:
                r = c.request(
                    method, path, content=chunks(), headers={"Content-Type": "application/json"}
                )
            except httpx.WriteError:
                continue  # the server answered and closed while we were still sending
            assert r.status_code == 413, (method, path, r.text)
        assert c.get("/healthz").status_code == 200
    reliability.record(
        f"request bodies over the limit on every route with a body ({len(routes)} routes),"
        " declared (300 MB) or chunked: 413",
        tries=2 * len(routes),
        outcome="refused",
        area="bounded requests",
    )


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_deeply_nested_json_is_refused_before_parsing(serve, reliability) -> None:  # type: ignore[no-untyped-def]
    live = serve()
    tries = 0
    with httpx.Client(base_url=live.url, timeout=HANG_GUARD_S) as c:
        for depth in (5_000, 100_000):
            manifest = b'{"format": 1, "files": [], "fingerprint": {"x": ' + _nested(depth) + b"}}"
            r = c.post("/v1/snapshots", content=manifest)
            assert r.status_code == 422 and r.json()["error"] == "invalid_manifest", r.text
            assert "nested deeper" in r.json()["detail"]
            fingerprint = b'{"workload": "wl", "fingerprint": {"x": ' + _nested(depth) + b"}}"
            for path in ("/v1/resolve", "/v1/agents"):
                r = c.post(path, content=fingerprint, headers={"Content-Type": "application/json"})
                assert r.status_code == 422 and r.json()["error"] == "invalid_request", r.text
            tries += 3
            # A workload is TOML: refused as invalid, not a RecursionError 500.
            toml = f"name = 'wl'\nx = {'[' * depth}{']' * depth}\n"
            r = c.put("/v1/workloads/wl", content=toml)
            assert r.status_code == 422 and r.json()["error"] == "invalid_workload", r.text
            assert "nested too deeply" in r.json()["detail"]
            tries += 1
        assert c.get("/healthz").status_code == 200
    reliability.record(
        "JSON nested 5,000 and 100,000 levels deep (publish, resolve, agents) and TOML as"
        " deep (workload): 422, no RecursionError 500",
        tries=tries,
        outcome="refused",
        area="bounded requests",
    )


def test_non_finite_numbers_are_refused(serve, reliability) -> None:  # type: ignore[no-untyped-def]
    live = serve()
    manifest, blobs = make_snapshot({"a.bin": b"finite"})
    raw = manifest.to_dict()
    raw.pop("fingerprint_digest", None)
    raw.pop("id", None)
    raw["fingerprint"] = dict(raw["fingerprint"], threads=12345.5)
    template = json.dumps(raw)
    tries = 0
    with httpx.Client(base_url=live.url, timeout=HANG_GUARD_S) as c:
        for digest, data in blobs.items():
            assert c.put(f"/v1/blobs/{digest}", content=data).is_success
        for bad in ("1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1" + "0" * 400 + ".5"):
            body = template.replace("12345.5", bad)
            r = c.post("/v1/snapshots", content=body)
            assert r.status_code == 422 and r.json()["error"] == "invalid_manifest", (bad, r.text)
            fp = json.dumps({"workload": "wl", "fingerprint": FINGERPRINT | {"threads": 12345.5}})
            r = c.post(
                "/v1/resolve",
                content=fp.replace("12345.5", bad),
                headers={"Content-Type": "application/json"},
            )
            assert r.status_code == 422 and r.json()["error"] == "invalid_request", (bad, r.text)
            tries += 2
        # Strings may say anything; finite numbers are fine.
        ok = template.replace("12345.5", '"NaN Infinity 1e999 [[[["')
        assert c.post("/v1/snapshots", content=ok).status_code == 201
        listing = c.get("/v1/snapshots").text
        json.loads(listing, parse_constant=lambda name: pytest.fail(f"served {name}"))
    reliability.record(
        "1e999, NaN, Infinity, -Infinity and a 400-digit float in a manifest or fingerprint:"
        " 422, nothing stored",
        tries=tries,
        outcome="refused",
        area="bounded requests",
    )
