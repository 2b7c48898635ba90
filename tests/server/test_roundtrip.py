"""Push -> publish -> resolve -> download against a real server, and the refusals on the way."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile

import httpx
import zstandard

from tests.helpers.metrics import sample
from tests.server.conftest import FINGERPRINT, make_snapshot, push, random_files


def test_push_publish_resolve_download_round_trip(client: httpx.Client) -> None:
    files = random_files(5, size=3000, seed=1) | {"big/blob.bin": b"x" * 300_000, "empty": b""}
    manifest, blobs = make_snapshot(files, workload="roundtrip", verified=True)

    missing = client.post("/v1/blobs/missing", json={"digests": sorted(blobs)}).json()["missing"]
    assert sorted(missing) == sorted(blobs)
    r = push(client, manifest, blobs)
    assert r.status_code == 201, r.text
    summary = r.json()
    assert summary["id"] == manifest.id and summary["created"] is True
    assert summary["verified"] is True and summary["file_count"] == 7
    assert client.post("/v1/blobs/missing", json={"digests": sorted(blobs)}).json() == {
        "missing": [],
        "uploads": [],  # a local-dir server has no presigned PUTs to give
    }

    again = client.post("/v1/snapshots", content=manifest.to_json())
    assert again.status_code == 200 and again.json()["created"] is False

    res = client.post(
        "/v1/resolve",
        json={"fingerprint": FINGERPRINT, "workload": "roundtrip", "driver_policy": "newer"},
    ).json()
    assert res["snapshot"]["id"] == manifest.id and res["verified"] and res["exact"]

    assert json.loads(client.get(f"/v1/snapshots/{manifest.id}").text) == manifest.to_dict()
    for entry in manifest.files:
        body = client.get(f"/v1/blobs/{entry.digest}", headers={"Accept-Encoding": "identity"})
        assert body.status_code == 200
        assert hashlib.sha256(body.content).hexdigest() == entry.digest
        assert int(body.headers["content-length"]) == entry.size_bytes

    # the archive holds the manifest first and each blob once, byte-exact
    archive = client.get(f"/v1/snapshots/{manifest.id}/archive")
    assert archive.headers["content-type"] == "application/zstd"
    raw = (
        zstandard.ZstdDecompressor()
        .stream_reader(io.BytesIO(archive.content), read_across_frames=True)
        .read()
    )
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r|") as tar:
        members = {}
        for i, member in enumerate(tar):
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            if i == 0:
                assert member.name == "manifest.json"
                assert json.loads(data) == manifest.to_dict()
            else:
                members[member.name] = data
    assert members == {f"blobs/{d}": b for d, b in blobs.items()}

    # the zstd CLI reads the multi-frame stream too
    out = subprocess.run(["zstd", "-dc"], input=archive.content, capture_output=True, check=True)
    assert out.stdout == raw

    one = sorted(blobs)[0]
    partial = client.post(f"/v1/snapshots/{manifest.id}/archive", json={"digests": [one]})
    raw = (
        zstandard.ZstdDecompressor()
        .stream_reader(io.BytesIO(partial.content), read_across_frames=True)
        .read()
    )
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r|") as tar:
        assert [m.name for m in tar] == ["manifest.json", f"blobs/{one}"]

    listed = client.get("/v1/snapshots", params={"workload": "roundtrip"}).json()["snapshots"]
    assert [s["id"] for s in listed] == [manifest.id]
    assert listed[0]["last_used_at"] is not None  # resolve and archive touched it

    metrics = client.get("/metrics").text
    assert sample(metrics, "cachekeeper_archive_requests_total") == 2
    assert sample(metrics, "cachekeeper_blob_downloads_total") == 7


def test_blob_range_and_zstd_encodings(client: httpx.Client) -> None:
    data = bytes(range(256)) * 4000
    digest = hashlib.sha256(data).hexdigest()
    body = zstandard.ZstdCompressor().compress(data)
    r = client.put(f"/v1/blobs/{digest}", content=body, headers={"Content-Encoding": "zstd"})
    assert r.status_code == 201 and r.json()["size_bytes"] == len(data)

    part = client.get(f"/v1/blobs/{digest}", headers={"Range": "bytes=1000-1999"})
    assert part.status_code == 206 and part.content == data[1000:2000]
    assert part.headers["content-range"] == f"bytes 1000-1999/{len(data)}"
    tail = client.get(f"/v1/blobs/{digest}", headers={"Range": "bytes=-10"})
    assert tail.content == data[-10:]
    bad = client.get(f"/v1/blobs/{digest}", headers={"Range": f"bytes={len(data)}-"})
    assert bad.status_code == 416

    framed = client.get(f"/v1/blobs/{digest}", headers={"Accept-Encoding": "zstd"})
    assert framed.headers["content-encoding"] == "zstd"
    assert framed.content == data  # httpx decodes zstd itself
    with client.stream("GET", f"/v1/blobs/{digest}", headers={"Accept-Encoding": "zstd"}) as raw:
        frame = b"".join(raw.iter_raw())
    assert int(raw.headers["content-length"]) == len(frame) < len(data)
    assert zstandard.ZstdDecompressor().decompressobj().decompress(frame) == data


def test_digest_mismatch_stores_nothing(client: httpx.Client) -> None:
    data = b"what was sent"
    claimed = hashlib.sha256(b"what was promised").hexdigest()
    r = client.put(f"/v1/blobs/{claimed}", content=data)
    assert r.status_code == 422
    body = r.json()
    assert body["error"] == "digest_mismatch"
    assert body["expected"] == claimed and body["actual"] == hashlib.sha256(data).hexdigest()
    assert client.post("/v1/blobs/missing", json={"digests": [claimed]}).json()["missing"] == [
        claimed
    ]
    assert client.get(f"/v1/blobs/{claimed}").status_code == 404


def test_bad_zstd_body_is_refused(client: httpx.Client) -> None:
    digest = hashlib.sha256(b"x").hexdigest()
    r = client.put(
        f"/v1/blobs/{digest}", content=b"not zstd at all", headers={"Content-Encoding": "zstd"}
    )
    assert r.status_code == 422 and r.json()["error"] == "digest_mismatch"


def test_publish_with_missing_blobs_lists_them(client: httpx.Client) -> None:
    manifest, blobs = make_snapshot(random_files(3, seed=7), workload="missing")
    first = sorted(blobs)[0]
    client.put(f"/v1/blobs/{first}", content=blobs[first])
    r = client.post("/v1/snapshots", content=manifest.to_json())
    assert r.status_code == 409
    assert r.json()["error"] == "blob_missing"
    assert r.json()["missing"] == sorted(set(blobs) - {first})
    assert client.get(f"/v1/snapshots/{manifest.id}").status_code == 404


def test_malformed_manifests_are_refused(client: httpx.Client) -> None:
    manifest, _ = make_snapshot({"a": b"a"})
    good = manifest.to_dict()
    cases = {
        "../escape": "unsafe_path",
        "/etc/passwd": "unsafe_path",
        "a/./b": "unsafe_path",
    }
    for path, code in cases.items():
        bad = json.loads(json.dumps(good))
        bad["files"][0]["path"] = path
        r = client.post("/v1/snapshots", json=bad)
        assert r.status_code == 422 and r.json()["error"] == code, (path, r.text)
    bad = dict(good, format=99)
    r = client.post("/v1/snapshots", json=bad)
    assert r.status_code == 422 and r.json()["error"] == "unsupported_format"
    bad = json.loads(json.dumps(good))
    bad["files"][0]["digest"] = "NOTHEX"
    assert client.post("/v1/snapshots", json=bad).json()["error"] == "invalid_manifest"
    r = client.post("/v1/snapshots", content=b"{not json")
    assert r.status_code == 422 and r.json()["error"] == "invalid_manifest"
    # a size that does not match the stored blob
    blob = b"sized"
    digest = hashlib.sha256(blob).hexdigest()
    client.put(f"/v1/blobs/{digest}", content=blob)
    bad = json.loads(json.dumps(good))
    bad["files"][0].update(digest=digest, size_bytes=999)
    r = client.post("/v1/snapshots", json=bad)
    assert r.status_code == 422 and "does not match" in r.json()["detail"]


def test_limits_answer_413(fresh_server) -> None:  # type: ignore[no-untyped-def]
    live = fresh_server(max_files=10, max_manifest_bytes=50_000, max_blob_bytes=1000)
    with httpx.Client(base_url=live.url) as c:
        manifest, _ = make_snapshot(random_files(11, size=1))
        r = c.post("/v1/snapshots", content=manifest.to_json())
        assert r.status_code == 413 and "11 files" in r.json()["detail"]
        r = c.post("/v1/snapshots", content=b"[" + b" " * 60_000 + b"]")
        assert r.status_code == 413 and r.json()["error"] == "payload_too_large"
        big = b"z" * 1001
        r = c.put(f"/v1/blobs/{hashlib.sha256(big).hexdigest()}", content=big)
        assert r.status_code == 413
        # a decompression bomb: a tiny zstd body that expands past the limit
        bomb = zstandard.ZstdCompressor().compress(b"\0" * 10_000_000)
        r = c.put(
            f"/v1/blobs/{hashlib.sha256(b'0' * 64).hexdigest()}",
            content=bomb,
            headers={"Content-Encoding": "zstd"},
        )
        assert r.status_code == 413, r.text
        assert list((live.settings.data_dir / "blobs").glob("??/??/*.zst")) == []


def test_errors_are_json_everywhere(client: httpx.Client) -> None:
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = client.get("/v1/blobs/not-a-digest")
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    r = client.post("/v1/resolve", json={"workload": "x"})
    assert r.status_code == 422 and "fingerprint" in r.json()["detail"]
    r = client.get(f"/v1/snapshots/{'0' * 64}")
    assert r.status_code == 404 and r.json()["error"] == "snapshot_not_found"
