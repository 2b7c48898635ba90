"""Blobs in S3-compatible object storage (issue 13), end to end on loopback.

A real S3 API server (moto, ``moto_s3`` in tests/conftest.py), the real cachekeeper
server with ``blob_store=s3://...`` (uvicorn on 127.0.0.1), the real CLI and client. moto
neither enforces a presigned URL's expiry nor checks ``x-amz-checksum-sha256``: an expired
URL is a 403 answered by the client's object-store transport (the test seam), and a
corrupt upload is one the store accepted, which the server must refuse at publish.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from cachekeeper.backends.s3 import S3Backend, checksum_b64
from cachekeeper.client.api import CacheClient
from cachekeeper.client.direct import ObjectStore
from cachekeeper.client.pull import pull
from cachekeeper.client.push import push
from cachekeeper.environment.fingerprint import collect
from cachekeeper.errors import BlobMissing
from cachekeeper.restore import is_restored
from cachekeeper.server.resources.blobs import delete_blob_rows
from cachekeeper.server.resources.snapshots import delete_snapshot
from cachekeeper.server.settings import Settings
from cachekeeper.snapshot.make import snapshot_dir
from cachekeeper.store import LocalStore
from tests.conftest import run_probe
from tests.e2e.conftest import ck, counter
from tests.helpers.caches import make_cache
from tests.helpers.live_server import TOKENS, LiveServer, start_server
from tests.helpers.moto_server import MotoServer

SERVED = "cachekeeper_http_response_bytes_total"
ARCHIVES = "cachekeeper_archive_requests_total"


@pytest.fixture(scope="module")
def bucket(moto_s3: MotoServer) -> str:
    return moto_s3.new_bucket()


@pytest.fixture(scope="module")
def live(bucket: str, tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("server")
    server = start_server(Settings(data_dir=data, tokens=TOKENS, blob_store=bucket))
    yield server
    server.stop()


def _server(tmp_path: Path, bucket: str, **settings: object) -> LiveServer:
    return start_server(
        Settings(data_dir=tmp_path / "server", tokens=TOKENS, blob_store=bucket, **settings)
    )


def _snapshot(tmp_path: Path, workload: str) -> tuple[object, LocalStore, Path]:
    src = tmp_path / f"{workload}-cache"
    make_cache(src)
    store = LocalStore(home=tmp_path / "ck-home")
    manifest = snapshot_dir(src, store=store, workload=workload, fingerprint=collect())
    return manifest, store, src


def _put(url: str, body: bytes, digest: str) -> None:
    answer = httpx.put(url, content=body, headers={"x-amz-checksum-sha256": checksum_b64(digest)})
    assert answer.status_code == 200, answer.text


@pytest.mark.slow
def test_prejob_downloads_from_the_store_and_a_fresh_process_hits(
    live, bucket, compiled_cache, tmp_path
):
    home = tmp_path / "home"
    before_in = counter(live.url, "cachekeeper_http_request_bytes_total")
    proc = ck("push", str(compiled_cache), "--workload", "flex", "--allow-unregistered",
              "--json", server=live.url, home=home)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pushed = json.loads(proc.stdout)
    assert pushed["created"] and pushed["uploaded_blobs"] == pushed["blob_count"] > 0
    # The blobs went to the object store, not through the server.
    sent_to_server = counter(live.url, "cachekeeper_http_request_bytes_total") - before_in
    assert sent_to_server < pushed["uploaded_bytes"] / 10, (sent_to_server, pushed)
    s3 = S3Backend.from_url(bucket)
    assert s3.has_archive(pushed["snapshot_id"])

    served, archives = counter(live.url, SERVED), counter(live.url, ARCHIVES)
    cache = tmp_path / "node-cache"
    proc = ck("prejob", "--workload", "flex", "--cache-dir", str(cache), "--strict",
              server=live.url, token="read-token", home=home)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert is_restored(pushed["snapshot_id"], cache)
    assert counter(live.url, ARCHIVES) == archives  # no archive through the server
    served_bytes = counter(live.url, SERVED) - served
    archive_bytes = next(a.stored_bytes for a in s3.archives() if a.digest == pushed["snapshot_id"])
    assert served_bytes < 64 << 10 and served_bytes < archive_bytes, (served_bytes, archive_bytes)
    counters = run_probe(cache)
    assert counters["inductor"].get("fxgraph_cache_miss", 0) == 0, counters
    assert counters["inductor"].get("fxgraph_cache_hit", 0) >= 1, counters


def test_an_expired_url_falls_back_to_the_server(live, tmp_path):
    manifest, store, _src = _snapshot(tmp_path, "expiring")
    with CacheClient(base_url=live.url, token="write-token") as client:
        report = push(tmp_path / "expiring-cache", client=client, workload="expiring", store=store)
        assert report.created

        def expired(request: httpx.Request) -> httpx.Response:  # what S3 answers late
            return httpx.Response(403, text="<Error><Code>AccessDenied</Code></Error>")

        archives = counter(live.url, ARCHIVES)
        with ObjectStore(transport=httpx.MockTransport(expired)) as objects:
            got = pull(
                client=client, workload="expiring", cache_dir=tmp_path / "a", objects=objects
            )
        assert got.archive_from == "server" and "HTTP 403" in (got.fallback_reason or "")
        assert counter(live.url, ARCHIVES) == archives + 1
        assert is_restored(report.snapshot_id, tmp_path / "a")
        direct = pull(client=client, workload="expiring", cache_dir=tmp_path / "b")
        assert direct.fallback_reason is None and direct.archive_from == "object_store"
        assert (tmp_path / "b" / "cd" / "kernel.so").read_bytes() == (
            tmp_path / "expiring-cache" / "cd" / "kernel.so"
        ).read_bytes()


@pytest.mark.parametrize("fault", ["missing", "corrupt"])
def test_publish_refuses_a_missing_or_corrupt_object(live, tmp_path, fault):
    manifest, store, src = _snapshot(tmp_path, f"bad-{fault}")
    big = max(manifest.files, key=lambda f: f.size_bytes).digest
    with CacheClient(base_url=live.url, token="write-token") as client:
        answer = client.missing(manifest.digests)
        # kernel.so is random bytes: new to the server; the other files other tests sent.
        assert {u.digest for u in answer.uploads} == set(answer.missing) and big in answer.missing
        for upload in answer.uploads:
            body = store.blobs.read(upload.digest)
            if upload.digest == big:
                if fault == "missing":
                    continue
                body = bytes([body[0] ^ 0xFF]) + body[1:]  # same size, other bytes
            _put(upload.url, body, upload.digest)
        with pytest.raises(BlobMissing) as refused:
            client.publish(manifest)
        assert refused.value.extra["missing"] == [big]
        # Nothing half-published: not resolvable, not listed.
        resolved = client.resolve(collect(), workload=f"bad-{fault}")
        assert resolved.snapshot is None
        # A push uploads the refused blob again and publishes.
        report = push(src, client=client, workload=f"bad-{fault}", store=store)
        assert report.created and report.uploaded_blobs >= 1
        assert client.resolve(collect(), workload=f"bad-{fault}").snapshot_id == manifest.id


@pytest.mark.slow  # waits for object ages (whole seconds)
def test_gc_never_collects_an_upload_whose_push_is_in_flight(bucket, tmp_path):
    """Uploaded objects with no row yet: the grace period keeps them; and a GC planned
    before the publish re-validates under the catalog's lock and keeps what it recorded."""
    manifest, store, src = _snapshot(tmp_path, "racing")
    s3 = S3Backend.from_url(bucket)

    def upload_all(client: CacheClient) -> None:
        for upload in client.missing(manifest.digests).uploads:
            _put(upload.url, store.blobs.read(upload.digest), upload.digest)

    # 1. The default grace period: a GC in the middle of the push takes nothing.
    with (
        _server(tmp_path / "graced", bucket) as live,
        CacheClient(base_url=live.url, token="write-token") as client,
    ):
        upload_all(client)
        services = live.app.state.services
        assert services.gc.plan().orphan_files == ()
        services.gc.execute(services.gc.plan())
        assert all(s3.stat(d) is not None for d in manifest.digests)

    # 2. No grace: GC plans to take the rowless objects, the publish lands, then GC runs.
    with (
        _server(tmp_path / "racy", bucket, gc_grace_s=0) as live,
        CacheClient(base_url=live.url, token="write-token") as client,
    ):
        services = live.app.state.services
        time.sleep(1.1)  # object ages are whole seconds in S3
        plan = services.gc.plan()
        assert set(plan.orphan_files) >= manifest.digests
        assert client.publish(manifest).created
        services.gc.execute(plan)
        assert all(s3.stat(d) is not None for d in manifest.digests)
        got = pull(client=client, workload="racing", cache_dir=tmp_path / "node")
        assert got.archive_from == "object_store" and is_restored(manifest.id, tmp_path / "node")

        # 3. GC first, publish second: the publish is refused naming the blobs, and a push
        # (which uploads them again) publishes.
        with live.app.state.services.catalog.writing() as tx:
            delete_snapshot(tx, manifest.id)
            delete_blob_rows(tx, manifest.digests)
        time.sleep(1.1)
        services.gc.execute(services.gc.plan())
        assert all(s3.stat(d) is None for d in manifest.digests)
        assert not s3.has_archive(manifest.id)
        with pytest.raises(BlobMissing):
            client.publish(manifest)
        assert push(src, client=client, workload="racing", store=store).created
