"""Attacker archives and manifests not already covered by tests/restore/test_restore.py and
tests/server/test_roundtrip.py (whose cases the reliability report counts too): non-UTF-8
names, repeated archive members, a manifest with millions of entries, a zstd bomb sent to
the server. Each is refused with nothing written inside or outside the target."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from pathlib import Path

import httpx
import pytest
import zstandard

from cachekeeper.errors import InvalidManifest, UnsafePath
from cachekeeper.restore import restore_archive
from cachekeeper.snapshot.manifest import MAX_FILES, FileEntry, Manifest
from tests.hardening.conftest import visible_files
from tests.helpers.live_server import start_server

FP = {"schema": 1}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _archive(out: Path, manifest_json: bytes, members: list[tuple[bytes | str, bytes]]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(
        fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape"
    ) as tar:
        for name, data in [("manifest.json", manifest_json), *members]:
            info = tarfile.TarInfo(
                name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name
            )
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return out


def _ok_json(files: dict[str, bytes]) -> bytes:
    entries = tuple(FileEntry(p, sha(d), len(d)) for p, d in files.items())
    return Manifest(files=entries, fingerprint=FP).to_json().encode()


def _refused(
    archive: Path,
    tmp_path: Path,
    error: type[Exception],
    *,
    verified: dict[str, bytes] | None = None,
) -> None:
    """Refused; the target holds nothing, or only ``verified`` (files the manifest declares
    whose bytes were checked before the refusal: an unsigned restore keeps those)."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    target = tmp_path / "dst"
    with pytest.raises(error):
        restore_archive(archive, target)
    assert visible_files(target) == (verified or {})
    assert list(outside.iterdir()) == []
    staging = target / ".cachekeeper" / "staging"
    assert not staging.exists() or list(staging.rglob("*")) == []


def test_non_utf8_names_are_refused(tmp_path: Path, reliability) -> None:
    good = _ok_json({"a": b"x"})
    raw_bytes = good.replace(b'"path":"a"', b'"path":"\xff\xfe"')
    lone_surrogate = good.replace(b'"path":"a"', b'"path":"\\udcff"')
    cases = [
        (
            _archive(tmp_path / "1.tar.zst", raw_bytes, [(f"blobs/{sha(b'x')}", b"x")]),
            InvalidManifest,
        ),
        (
            _archive(tmp_path / "2.tar.zst", lone_surrogate, [(f"blobs/{sha(b'x')}", b"x")]),
            UnsafePath,
        ),
        (
            _archive(
                tmp_path / "3.tar.zst", good, [(b"blobs/\xff" + sha(b"x").encode()[1:], b"x")]
            ),
            UnsafePath,
        ),
    ]
    for archive, error in cases:
        _refused(archive, tmp_path, error)
    reliability.record(
        "non-UTF-8 names (manifest bytes, lone surrogate, archive member)",
        tries=len(cases),
        outcome="refused",
        area="attacker input",
    )


def test_repeated_archive_member_is_refused(tmp_path: Path, reliability) -> None:
    members = [(f"blobs/{sha(b'x')}", b"x"), (f"blobs/{sha(b'x')}", b"y")]
    _refused(
        _archive(tmp_path / "dup.tar.zst", _ok_json({"a": b"x"}), members),
        tmp_path,
        InvalidManifest,
        verified={"a": b"x"},
    )
    reliability.record(
        "archive member repeated (second copy differs)",
        tries=1,
        outcome="refused",
        area="attacker input",
    )


def _huge_manifest_json(entries: int) -> bytes:
    entry = json.dumps({"path": "a", "digest": "0" * 64, "size_bytes": 1, "mode": 420}).encode()
    head = json.dumps({"format": 1, "fingerprint": FP, "files": []}).encode()[:-2]
    return head + b"[" + b",".join([entry] * entries) + b"]}"


def test_manifest_with_millions_of_entries_is_refused_before_parsing(
    tmp_path: Path, reliability
) -> None:
    """a million entries (about 85 MB of JSON): refused by a byte scan, in well under the
    time parsing would take (parsing alone builds a million dicts)."""
    body = _huge_manifest_json(1_000_000)
    assert body.count(b'"digest"') == 1_000_000 > MAX_FILES
    archive = tmp_path / "huge.tar.zst"
    _archive(archive, body, [])
    started = time.monotonic()
    _refused(archive, tmp_path, InvalidManifest)
    took = time.monotonic() - started
    reliability.record(
        f"archive manifest with 1,000,000 entries (refused in {took:.1f} s)",
        tries=1,
        outcome="refused",
        area="attacker input",
    )

    from cachekeeper.server.settings import Settings

    handle = start_server(Settings(data_dir=tmp_path / "data", max_manifest_bytes=512 << 20))
    try:
        for server, label in ((handle, "under a raised byte limit"),):
            answer = httpx.post(f"{server.url}/v1/snapshots", content=body, timeout=120)
            assert answer.status_code == 413, answer.text[:300]
            assert answer.json()["error"] == "payload_too_large"
            assert httpx.get(f"{server.url}/v1/snapshots").json()["snapshots"] == []
            reliability.record(
                f"publish of a 1,000,000-entry manifest ({label}): 413",
                tries=1,
                outcome="refused",
                area="attacker input",
            )
    finally:
        handle.stop()


def test_zstd_bomb_upload_is_cut_off(tmp_path: Path, reliability) -> None:
    """A 10 KB zstd body that expands to 1 GiB, uploaded as a blob: the server stops at
    its blob limit (413) and stores nothing."""
    from cachekeeper.server.settings import Settings

    handle = start_server(Settings(data_dir=tmp_path / "data", max_blob_bytes=16 << 20))
    try:
        cctx = zstandard.ZstdCompressor(level=19).compressobj()
        bomb = b"".join(cctx.compress(bytes(1 << 20)) for _ in range(1024)) + cctx.flush()
        assert len(bomb) < 200_000
        digest = "ab" * 32
        answer = httpx.put(
            f"{handle.url}/v1/blobs/{digest}",
            content=bomb,
            headers={"Content-Encoding": "zstd"},
            timeout=120,
        )
        assert answer.status_code in (413, 422), answer.text
        assert list((handle.settings.data_dir / "blobs").glob("??/??/*.zst")) == []
    finally:
        handle.stop()
    reliability.record(
        "zstd bomb (1 GiB from a tiny body) uploaded as a blob",
        tries=1,
        outcome="refused",
        area="attacker input",
    )
