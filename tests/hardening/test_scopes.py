"""What each scope can do on an object-store server (issue 24, "Scopes").

``POST /v1/blobs/missing`` is a read route; on a server whose blobs are in an object store
it also hands out presigned PUT URLs, and such a URL writes into the bucket whatever the
server's own upload route would refuse. So: upload URLs only for a write-scope caller, and a
bounded number of digests per request (each missing one costs a presign). A real S3 API
(moto), the real server on loopback.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import boto3
import httpx
import pytest

from cachekeeper.backends.s3 import parse_s3_url
from cachekeeper.server.settings import Settings
from cachekeeper.wire.snapshots import MAX_MISSING_DIGESTS
from tests.helpers.live_server import TOKENS, LiveServer, start_server
from tests.helpers.moto_server import MotoServer


@pytest.fixture
def s3_server(s3_bucket: str, tmp_path) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    settings = Settings(
        data_dir=tmp_path / "data", tokens=TOKENS, anonymous_read=True, blob_store=s3_bucket
    )
    with start_server(settings) as handle:
        yield handle


def _digests(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def _objects(moto_s3: MotoServer, bucket_url: str) -> list[str]:
    where = parse_s3_url(bucket_url)
    client = boto3.session.Session().client("s3", endpoint_url=moto_s3.url)
    found = client.list_objects_v2(Bucket=where.bucket, Prefix=where.prefix)
    return [o["Key"] for o in found.get("Contents", [])]


def test_only_a_write_token_gets_upload_urls(
    s3_server: LiveServer, s3_bucket: str, moto_s3: MotoServer, reliability
) -> None:
    wanted = _digests(3, "scope")
    callers = {
        "anonymous": {},
        "read": {"Authorization": "Bearer read-token"},
        "write": {"Authorization": "Bearer write-token"},
    }
    answers = {
        who: httpx.post(
            f"{s3_server.url}/v1/blobs/missing", json={"digests": wanted}, headers=headers
        )
        for who, headers in callers.items()
    }
    for who, answer in answers.items():
        assert answer.status_code == 200, (who, answer.text)
        assert sorted(answer.json()["missing"]) == sorted(wanted), who
    assert answers["anonymous"].json()["uploads"] == []
    assert answers["read"].json()["uploads"] == []
    uploads = answers["write"].json()["uploads"]
    assert sorted(u["digest"] for u in uploads) == sorted(wanted)
    # A read token has no way into the bucket: no URL, and the upload route needs write.
    refused = httpx.put(
        f"{s3_server.url}/v1/blobs/{wanted[0]}",
        content=b"x",
        headers={"Authorization": "Bearer read-token"},
    )
    assert refused.status_code == 403
    assert _objects(moto_s3, s3_bucket) == []
    reliability.record(
        "blobs/missing on an object-store server, anonymous and read token: missing listed,"
        " no presigned upload URL (write token: one per blob); nothing reaches the bucket",
        tries=2,
        outcome="refused",
        area="scopes",
    )


def test_one_request_names_a_bounded_number_of_digests(s3_server: LiveServer, reliability) -> None:
    headers = {"Authorization": "Bearer write-token"}
    too_many = _digests(MAX_MISSING_DIGESTS + 1, "many")
    started = time.monotonic()
    answer = httpx.post(
        f"{s3_server.url}/v1/blobs/missing", json={"digests": too_many}, headers=headers
    )
    refused_in = time.monotonic() - started
    assert answer.status_code == 422, answer.text[:300]
    assert answer.json()["error"] == "invalid_request"
    assert f"at most {MAX_MISSING_DIGESTS} items" in answer.json()["detail"]
    at_limit = httpx.post(
        f"{s3_server.url}/v1/blobs/missing",
        json={"digests": too_many[:MAX_MISSING_DIGESTS]},
        headers=headers,
        timeout=60,
    )
    assert at_limit.status_code == 200
    assert len(at_limit.json()["uploads"]) == MAX_MISSING_DIGESTS
    reliability.record(
        f"blobs/missing naming {MAX_MISSING_DIGESTS + 1:,} digests (each a presign on an"
        f" object-store server): 422 before any presign (in {refused_in:.2f} s);"
        f" {MAX_MISSING_DIGESTS:,} are answered",
        tries=1,
        outcome="refused",
        area="scopes",
    )
