"""``/v1/tier/...`` (server/routes/tier.py): the per-key tier over HTTP, in process, on a
local store and on a real S3 API (moto): what is served to whom, who is recorded as the
writer, and that no bytes reach a key without the server checking them."""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from cachekeeper.server.auth import token_id
from cachekeeper.server.resources.tier_keys import tier_key
from cachekeeper.server.settings import Settings
from tests.helpers.in_process import in_process
from tests.helpers.moto_server import MotoServer

TOKENS = {"node-write": "write", "node-read": "read"}
WRITE = {"Authorization": "Bearer node-write"}
READ = {"Authorization": "Bearer node-read"}
ENV = "0123456789ab"
KEY = "pt2:fx-graph-v1::fabcdef0123:c1"
VALUE = b"torch's json value " * 500


def sha(value: bytes) -> str:
    return hashlib.sha256(value).hexdigest()


def url(key: str) -> str:
    return f"/v1/tier/values/{quote(key, safe='')}"


def put(client: httpx.Client, key: str, value: bytes, *, env: str = ENV, headers=WRITE):
    plan = client.post(
        "/v1/tier/puts",
        json={"key": key, "digest": sha(value), "size_bytes": len(value), "environment": env},
        headers=headers,
    )
    assert plan.status_code == 200, plan.text
    if plan.json()["action"] != "send":
        return plan.json()
    sent = client.put(
        url(key),
        content=value,
        headers={**headers, "X-Cachekeeper-Digest": sha(value), "X-Cachekeeper-Environment": env},
    )
    assert sent.status_code in (200, 201), sent.text
    return sent.json()


def get(client: httpx.Client, key: str, *, env: str = ENV, headers=READ) -> httpx.Response:
    return client.get(url(key), headers={**headers, "X-Cachekeeper-Environment": env})


def settings(tmp_path: Path, **extra) -> Settings:
    return Settings(data_dir=tmp_path / "data", tokens=TOKENS, resp_port=0, **extra)


def test_a_value_put_and_got_back_with_its_digest_and_the_token_as_its_writer(
    tmp_path: Path,
) -> None:
    with in_process(settings(tmp_path)) as server:
        assert get(server.client, KEY).status_code == 404  # a miss
        assert put(server.client, KEY, VALUE) == {
            "action": "stored",
            "url": None,
            "headers": None,
            "reason": None,
        }
        got = get(server.client, KEY)
        assert got.status_code == 200 and got.content == VALUE
        assert got.headers["x-cachekeeper-digest"] == sha(VALUE)
        assert got.headers["x-cachekeeper-size"] == str(len(VALUE))
        entry = tier_key(server.app.state.tier.catalog, KEY.encode())
        assert entry.writer["token"] == token_id("node-write") and entry.writer["via"] == "http"
        assert entry.writer["environment"] == ENV
        assert "node-write" not in str(entry.writer)  # an id, never the token


def test_the_same_bytes_under_another_key_are_not_sent_again(tmp_path: Path) -> None:
    with in_process(settings(tmp_path)) as server:
        put(server.client, KEY, VALUE)
        again = put(server.client, KEY + "-2", VALUE)
        assert again["action"] == "stored"  # answered by the question alone
        assert get(server.client, KEY + "-2").content == VALUE


def test_a_value_from_another_environment_is_a_miss_unless_the_operator_allows_it(
    tmp_path: Path,
) -> None:
    with in_process(settings(tmp_path / "strict")) as server:
        put(server.client, KEY, VALUE, env=ENV)
        assert get(server.client, KEY, env="ffffffffffff").status_code == 404
        assert get(server.client, KEY, env="").status_code == 404
        assert get(server.client, KEY, env=ENV).status_code == 200
        metrics = server.app.state.metrics
        assert metrics.value("cachekeeper_remote_cache_gets_total", result="other_environment") == 2
    with in_process(settings(tmp_path / "open", remote_cache_cross_environment=True)) as server:
        put(server.client, KEY, VALUE, env=ENV)
        assert get(server.client, KEY, env="ffffffffffff").status_code == 200


def test_a_read_token_puts_nothing_and_is_told_why(tmp_path: Path) -> None:
    with in_process(settings(tmp_path)) as server:
        answer = put(server.client, KEY, VALUE, headers=READ)
        assert answer["action"] == "dropped" and answer["reason"] == "read_only_token"
        refused = server.client.put(
            url(KEY), content=VALUE, headers={**READ, "X-Cachekeeper-Digest": sha(VALUE)}
        )
        assert refused.status_code == 403
        assert get(server.client, KEY).status_code == 404


def test_bytes_that_are_not_their_digest_are_refused_and_nothing_is_stored(
    tmp_path: Path,
) -> None:
    with in_process(settings(tmp_path)) as server:
        wrong = server.client.put(
            url(KEY), content=VALUE + b"!", headers={**WRITE, "X-Cachekeeper-Digest": sha(VALUE)}
        )
        assert wrong.status_code == 422 and wrong.json()["error"] == "digest_mismatch"
        assert get(server.client, KEY).status_code == 404


def test_a_value_over_the_cap_is_dropped_before_it_is_sent(tmp_path: Path) -> None:
    with in_process(settings(tmp_path, remote_cache_max_value_bytes=1000)) as server:
        answer = put(server.client, KEY, VALUE)
        assert answer == {"action": "dropped", "url": None, "headers": None, "reason": "too_large"}


def test_a_server_without_a_tier_answers_404(tmp_path: Path) -> None:
    with in_process(Settings(data_dir=tmp_path / "data", tokens=TOKENS)) as server:
        assert get(server.client, KEY).status_code == 404
        plan = server.client.post(
            "/v1/tier/puts", json={"key": KEY, "digest": sha(VALUE), "size_bytes": 3}, headers=WRITE
        )
        assert plan.status_code == 404 and "serves no per-key tier" in plan.json()["detail"]


@pytest.mark.slow  # a real S3 API (moto) on loopback
def test_with_an_object_store_values_move_by_presigned_url_and_are_checked(
    tmp_path: Path, moto_s3: MotoServer
) -> None:
    s = settings(tmp_path, blob_store=moto_s3.new_bucket())
    with in_process(s) as server, httpx.Client() as store:
        plan = put(server.client, KEY, VALUE)
        assert plan["action"] == "upload" and plan["url"].startswith("http")
        # a node that uploads other bytes under the digest: the commit refuses them
        assert store.put(plan["url"], content=VALUE + b"!", headers=plan["headers"]).is_success
        lie = server.client.post(
            "/v1/tier/commits",
            json={"key": KEY, "digest": sha(VALUE), "size_bytes": len(VALUE), "environment": ENV},
            headers=WRITE,
        )
        assert lie.status_code == 422 and lie.json()["error"] == "digest_mismatch"
        assert get(server.client, KEY).status_code == 404
        # the honest upload, then its commit
        assert store.put(plan["url"], content=VALUE, headers=plan["headers"]).is_success
        done = server.client.post(
            "/v1/tier/commits",
            json={"key": KEY, "digest": sha(VALUE), "size_bytes": len(VALUE), "environment": ENV},
            headers=WRITE,
        )
        assert done.status_code == 201 and done.json()["action"] == "stored"
        got = get(server.client, KEY)
        assert got.status_code == 307 and got.content == b""  # no value bytes through the server
        assert got.headers["x-cachekeeper-digest"] == sha(VALUE)
        fetched = store.get(got.headers["location"])  # no token: the URL is signed
        assert fetched.content == VALUE
        # a herd shares one signature: the second GET is answered with the same URL
        assert get(server.client, KEY).headers["location"] == got.headers["location"]
