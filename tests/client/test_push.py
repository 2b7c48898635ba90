"""client/push.py: the push report's JSON (``push --json``, a CLI contract), and how long
a push waits for its publish (a real server on loopback)."""

from __future__ import annotations

import random
from pathlib import Path

import httpx

from cachekeeper.client.api import CacheClient
from cachekeeper.client.push import PushReport, publish_timeout_for, push
from cachekeeper.server.settings import Settings
from cachekeeper.store import LocalStore
from tests.helpers.live_server import start_server
from tests.server.conftest import FINGERPRINT


def test_push_report_json_is_its_fields_in_order() -> None:
    report = PushReport(
        snapshot_id="a" * 64,
        workload="w",
        created=True,
        file_count=2,
        blob_count=2,
        uploaded_blobs=1,
        uploaded_bytes=10,
        uploaded_wire_bytes=7,
        deduplicated_blobs=1,
        deduplicated_bytes=5,
        unverified_reason="not prewarmed",
    )
    assert list(report.to_dict().items()) == [
        ("snapshot_id", "a" * 64),
        ("workload", "w"),
        ("created", True),
        ("file_count", 2),
        ("blob_count", 2),
        ("uploaded_blobs", 1),
        ("uploaded_bytes", 10),
        ("uploaded_wire_bytes", 7),
        ("deduplicated_blobs", 1),
        ("deduplicated_bytes", 5),
        ("verified", False),
        ("unverified_reason", "not prewarmed"),
        ("offered", True),
    ]


def test_the_publish_deadline_grows_with_the_snapshots_bytes_and_blobs() -> None:
    assert publish_timeout_for(blob_bytes=0, blob_count=0) == 30.0
    assert publish_timeout_for(blob_bytes=0, blob_count=0, floor_s=5.0) == 5.0
    assert publish_timeout_for(blob_bytes=2 << 20, blob_count=0) == 31.0
    assert publish_timeout_for(blob_bytes=0, blob_count=1000) == 50.0
    # The 350 MB synthetic snapshot of bench/s3_bench.py (about 4,300 blobs).
    assert 250 < publish_timeout_for(blob_bytes=350 << 20, blob_count=4300) < 300


class _Recording(httpx.HTTPTransport):
    """The real transport, noting each request's read timeout (what the client set)."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[tuple[str, str, float]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        read = request.extensions["timeout"]["read"]
        self.timeouts.append((request.method, request.url.path, read))
        return super().handle_request(request)


def test_push_waits_for_its_publish_by_the_rule_and_other_requests_by_the_client(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    (cache / "fxgraph").mkdir(parents=True)
    sizes = [3 << 20, 1 << 20, 1000]
    for i, size in enumerate(sizes):
        (cache / "fxgraph" / f"{i}.bin").write_bytes(random.Random(i).randbytes(size))
    store = LocalStore(home=tmp_path / "home")
    starts: list[tuple[int, int, float]] = []
    with start_server(Settings(data_dir=tmp_path / "server")) as live:
        transport = _Recording()
        with CacheClient(base_url=live.url, timeout_s=7.0, transport=transport) as client:
            report = push(
                cache,
                client=client,
                workload="w",
                store=store,
                fingerprint=FINGERPRINT,
                on_publish=lambda *args: starts.append(args),
            )
            assert report.created
            again = push(
                cache,
                client=client,
                workload="w",
                store=store,
                fingerprint=FINGERPRINT,
                publish_timeout_s=123.0,
            )
            assert not again.created
    rule = publish_timeout_for(blob_bytes=sum(sizes), blob_count=3, floor_s=7.0)
    assert starts == [(sum(sizes), 3, rule)]
    publishes = [t for method, path, t in transport.timeouts if path == "/v1/snapshots"]
    assert publishes == [rule, 123.0]
    others = {t for method, path, t in transport.timeouts if path != "/v1/snapshots"}
    assert others == {7.0}
