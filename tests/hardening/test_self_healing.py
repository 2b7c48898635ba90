"""A self-healing object store (issue 24): an archive object or a blob object damaged or
replaced behind the server's back is repaired by the next push of the same dir, and nodes
are not sent cold meanwhile. A real S3 API (moto), the real server, the real push and pull;
the damage is done with boto3, as anything else with the bucket's credentials could."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from cachekeeper.backends.s3 import parse_s3_url
from cachekeeper.client.api import CacheClient
from cachekeeper.client.pull import pull
from cachekeeper.client.push import push
from cachekeeper.environment.fingerprint import collect
from cachekeeper.server.settings import Settings
from tests.hardening.conftest import visible_files
from tests.helpers.live_server import TOKENS, LiveServer, start_server
from tests.helpers.moto_server import MotoServer

FP = collect()


@pytest.fixture
def s3_server(s3_bucket: str, tmp_path: Path) -> Iterator[LiveServer]:
    settings = Settings(data_dir=tmp_path / "data", tokens=TOKENS, blob_store=s3_bucket)
    with start_server(settings) as handle:
        yield handle


def _dir(root: Path, tag: str, *, shared: bytes) -> Path:
    files = {
        "fxgraph/ab/k/entry": f"graph of {tag}".encode() * 200,
        "cd/kernel.so": os.urandom(300_000),
        "ef/shared.py": shared,
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _push(server: LiveServer, src: Path, tmp_path: Path) -> str:
    with CacheClient(base_url=server.url, token="write-token") as client:
        return push(src, client=client, workload="wl", fingerprint=FP).snapshot_id


def _pull(server: LiveServer, dst: Path):  # type: ignore[no-untyped-def]
    with CacheClient(base_url=server.url, token="read-token") as client:
        return pull(client=client, workload="wl", cache_dir=dst, fingerprint=FP)


class Bucket:
    def __init__(self, moto: MotoServer, url: str) -> None:
        where = parse_s3_url(url)
        self.name, self.prefix = where.bucket, where.prefix
        self.s3 = boto3.session.Session().client("s3", endpoint_url=moto.url)

    def get(self, key: str) -> bytes:
        return self.s3.get_object(Bucket=self.name, Key=self.prefix + key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=self.name, Key=self.prefix + key, Body=data)


def test_a_swapped_or_flipped_archive_is_served_around_and_repaired_by_a_push(
    s3_server: LiveServer, s3_bucket: str, moto_s3: MotoServer, tmp_path: Path, reliability
) -> None:
    bucket = Bucket(moto_s3, s3_bucket)
    src_a = _dir(tmp_path / "a", "a", shared=b"print('a')\n" * 50)
    src_b = _dir(tmp_path / "b", "b", shared=b"print('b')\n" * 50)
    id_b = _push(s3_server, src_b, tmp_path)
    id_a = _push(s3_server, src_a, tmp_path)  # pushed last: resolve picks it
    good = bucket.get(f"archives/{id_a}.tar.zst")
    damages = {
        "swapped for another snapshot's archive": bucket.get(f"archives/{id_b}.tar.zst"),
        "one byte flipped": good[: len(good) // 2]
        + bytes([good[len(good) // 2] ^ 1])
        + good[len(good) // 2 + 1 :],
    }
    for i, (what, damaged) in enumerate(damages.items()):
        bucket.put(f"archives/{id_a}.tar.zst", damaged)
        node = tmp_path / f"node-{i}"
        meanwhile = _pull(s3_server, node)  # the node is not sent cold meanwhile
        assert meanwhile.outcome == "restored" and meanwhile.archive_from == "server", what
        assert visible_files(node) == visible_files(src_a)
        _push(s3_server, src_a, tmp_path)  # the same dir again: repairs the archive
        assert bucket.get(f"archives/{id_a}.tar.zst") != damaged, what
        after = _pull(s3_server, tmp_path / f"node-{i}-after")
        assert after.outcome == "restored" and after.archive_from == "object_store", what
        assert visible_files(tmp_path / f"node-{i}-after") == visible_files(src_a)
        reliability.record(
            f"archive object {what} behind the server's back: nodes restore from the"
            " server's stream of the blobs meanwhile; the next push of the same dir"
            " rewrites it, and nodes download it from the store again",
            tries=1,
            outcome="recovered",
            area="server state",
        )


def test_a_replaced_blob_object_is_uploaded_again_by_the_next_push(
    s3_server: LiveServer, s3_bucket: str, moto_s3: MotoServer, tmp_path: Path, reliability
) -> None:
    bucket = Bucket(moto_s3, s3_bucket)
    shared = b"def shared():\n    return 1\n" * 40
    src_a = _dir(tmp_path / "a", "a", shared=shared)
    id_a = _push(s3_server, src_a, tmp_path)
    import hashlib

    digest = hashlib.sha256(shared).hexdigest()
    bucket.put(f"blobs/{digest}", b"X" * len(shared))  # other bytes, the same size
    # A new dir that shares the blob: its publish reads the blob back and finds it wrong.
    src_c = _dir(tmp_path / "c", "c", shared=shared)
    id_c = _push(s3_server, src_c, tmp_path)
    assert bucket.get(f"blobs/{digest}") == shared  # uploaded again, not refused forever
    assert visible_files(_pull_dir(s3_server, tmp_path / "node-c")) == visible_files(src_c)
    # ... and the same dir again, once its archive must be rebuilt, publishes too.
    bucket.put(f"blobs/{digest}", b"Y" * len(shared))
    bucket.s3.delete_object(Bucket=bucket.name, Key=f"{bucket.prefix}archives/{id_a}.tar.zst")
    assert _push(s3_server, src_a, tmp_path) == id_a
    assert bucket.get(f"blobs/{digest}") == shared
    assert id_c != id_a
    reliability.record(
        "blob object replaced with other bytes of the same size behind the server's back:"
        " the next push (of a new dir sharing it, or of the same dir once its archive is"
        " rebuilt) removes the wrong object, uploads the blob again and publishes",
        tries=2,
        outcome="recovered",
        area="server state",
    )


def _pull_dir(server: LiveServer, dst: Path) -> Path:
    report = _pull(server, dst)
    assert report.outcome == "restored"
    return dst
