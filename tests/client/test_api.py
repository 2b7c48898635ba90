"""CacheClient's own logic through httpx's transport seam: retries, deadlines, error mapping.

What only a real server shows (uploads, archives, auth) is in tests/e2e/test_push_pull_prejob.py.
"""

from __future__ import annotations

import json

import httpx
import pytest

from cachekeeper.client.api import CacheClient, Deadline
from cachekeeper.errors import (
    BlobMissing,
    Forbidden,
    NoMatchingSnapshot,
    ServerError,
    ServerUnavailable,
    Unauthorized,
)
from cachekeeper.fingerprint import describe_mismatch
from tests.helpers.bodies import summary_body

SERVER = "http://127.0.0.1:8750"  # loopback: a token may go over http (calls.refuse_plaintext)
FP = {"torch": "2.13.0+cpu"}
SNAP_ID = "a" * 64


def client_for(handler, **kwargs) -> CacheClient:
    kwargs.setdefault("backoff_s", 0.001)
    return CacheClient(base_url=SERVER, transport=httpx.MockTransport(handler), **kwargs)


def resolve_answer(snapshot_id: str | None = SNAP_ID) -> dict:
    snapshot = None if snapshot_id is None else summary_body(snapshot_id)
    return {"snapshot": snapshot, "verified": True, "exact": True, "near_misses": []}


def test_retries_5xx_then_succeeds():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) < 3:
            return httpx.Response(503, json={"error": "server_unavailable", "detail": "busy"})
        return httpx.Response(200, json=resolve_answer())

    with client_for(handler, retries=3) as client:
        resolution = client.resolve(FP, workload="w")
    assert resolution.snapshot_id == SNAP_ID
    assert len(calls) == 3
    assert json.loads(calls[0].content)["fingerprint"] == FP


def test_5xx_after_retries_maps_the_servers_error_code():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(500, json={"error": "server_error", "detail": "db is locked"})

    with client_for(handler, retries=2) as client, pytest.raises(ServerError, match="db is locked"):
        client.resolve(FP, workload="w")
    assert len(calls) == 3  # the first try and two retries


def test_connection_errors_are_retried_then_server_unavailable():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("connection refused", request=request)

    with client_for(handler, retries=2) as client:
        with pytest.raises(ServerUnavailable, match="connection refused") as info:
            client.health()
    assert len(calls) == 3
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_4xx_is_not_retried_and_keeps_class_and_extra():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(
            409, json={"error": "blob_missing", "detail": "2 blobs missing", "missing": ["b" * 64]}
        )

    with client_for(handler) as client, pytest.raises(BlobMissing) as info:
        client.missing_blobs({"b" * 64})
    assert len(calls) == 1
    # the server's detail first, then the request that got it
    assert info.value.detail.startswith("2 blobs missing (POST http")
    assert info.value.detail.endswith("/v1/blobs/missing)")
    assert info.value.extra == {"missing": ["b" * 64]}


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [(401, "unauthorized", Unauthorized), (403, "forbidden", Forbidden)],
)
def test_auth_errors_map_to_their_classes(status, code, cls):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": code, "detail": "no"})

    with client_for(handler) as client, pytest.raises(cls):
        client.resolve(FP, workload="w")


def test_token_is_sent_as_bearer():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json=resolve_answer())

    with client_for(handler, token="s3cret") as client:
        client.resolve(FP, workload="w")
    with client_for(handler) as client:
        client.resolve(FP, workload="w")
    assert seen == ["Bearer s3cret", None]


@pytest.mark.parametrize(
    "body",
    [
        b"<html>oops</html>",
        b"[1, 2]",
        b'{"no_snapshot_key": 1}',
        b'{"snapshot": {"id": "x"}}',
        json.dumps({**resolve_answer(), "snapshot": summary_body("x")}).encode(),
        json.dumps(
            {**resolve_answer(), "near_misses": [{"snapshot": summary_body(SNAP_ID)}]}
        ).encode(),
    ],
)
def test_garbage_answers_are_server_errors(body):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body)

    with client_for(handler) as client, pytest.raises(ServerError):
        client.resolve(FP, workload="w")


def test_non_json_error_body_is_a_server_error_naming_the_status():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(418, text="I'm a teapot")

    with client_for(handler) as client, pytest.raises(ServerError, match="HTTP 418"):
        client.health()


def test_unknown_error_code_is_a_server_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "brand_new_code", "detail": "hm"})

    with client_for(handler) as client, pytest.raises(ServerError, match="hm"):
        client.health()


def test_a_miss_is_a_value_with_near_misses():
    answer = {
        "snapshot": None,
        "verified": False,
        "exact": False,
        "near_misses": [
            {
                "snapshot": summary_body(SNAP_ID),
                "mismatches": [{"field": "torch", "node": "2.13.0+cpu", "snapshot": "2.11.0"}],
            }
        ],
    }

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    with client_for(handler) as client:
        resolution = client.resolve(FP, workload="w")
    assert resolution.snapshot is None
    assert (
        describe_mismatch(resolution.near_misses[0].mismatches[0]) == "torch 2.13.0+cpu != 2.11.0"
    )


def test_resolve_snapshot_raises_no_match_naming_fields():
    from cachekeeper.client.pull import resolve_snapshot

    answer = resolve_answer(None)
    answer["near_misses"] = [
        {
            "snapshot": summary_body(SNAP_ID),
            "mismatches": [{"field": "torch", "node": "2.13.0+cpu", "snapshot": "2.11.0+cu130"}],
        }
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    with client_for(handler) as client, pytest.raises(NoMatchingSnapshot) as info:
        resolve_snapshot(client, workload="w", fingerprint=FP)
    assert "torch 2.13.0+cpu != 2.11.0+cu130" in info.value.detail


def test_deadline_bounds_retries():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("refused", request=request)

    client = client_for(handler, retries=1000, backoff_s=0.05)
    with client, pytest.raises(ServerUnavailable):
        client.health(deadline=Deadline(0.5))
    # A retry sleeps only when the deadline leaves room, and the k-th sleep is at least
    # 0.05 * 2**k / 2 s: at most 4 sleeps fit 0.5 s, however loaded the machine (slower only
    # means fewer), so the deadline, not the 1000 retries, ended it.
    assert 1 <= len(calls) <= 5


def test_expired_deadline_sends_nothing():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200, json={"status": "ok"})

    deadline = Deadline(0.0)
    with client_for(handler) as client, pytest.raises(ServerUnavailable, match="deadline"):
        client.health(deadline=deadline)
    assert calls == []


def test_manifest_with_another_id_is_refused():
    from cachekeeper.manifest import Manifest

    manifest = Manifest(files=(), fingerprint=FP)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=manifest.to_dict())

    with client_for(handler) as client:
        assert client.get_manifest(manifest.id).id == manifest.id
        with pytest.raises(ServerError, match="with id"):
            client.get_manifest(SNAP_ID)


def test_missing_server_url_is_server_unavailable():
    with pytest.raises(ServerUnavailable, match="no server configured"):
        CacheClient(base_url="")
