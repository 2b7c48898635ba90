"""The archive format module: one format for the one-file snapshot and the server's stream,
and ReadAhead, the background-thread reader restore uses to overlap decompression with writes."""

from __future__ import annotations

import io
import random
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard

from cachekeeper.archive import (
    BLOCK,
    BlobSlot,
    ReadAhead,
    blob_digest,
    blob_member,
    iter_tar,
    layout,
    member_header,
    read_manifest_member,
    write_tar,
)
from cachekeeper.errors import BlobMissing
from cachekeeper.manifest import Manifest
from cachekeeper.server.archive import archive_chunks
from cachekeeper.snapshot import snapshot_dir, write_archive
from cachekeeper.store import LocalStore

FP = {"schema": 1, "torch": "test", "gpus": []}


def _store_with_files(tmp_path: Path, files: dict[str, bytes]) -> tuple[LocalStore, Manifest]:
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    store = LocalStore(home=tmp_path / "home")
    return store, snapshot_dir(src, store=store, fingerprint=FP, workload="w")


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 8**11 - 1, 8**11])
def test_member_header_is_what_tarfile_writes_and_reads(size: int) -> None:
    name = blob_member("ab" * 32)
    header = member_header(name, size)
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    assert header == info.tobuf(format=tarfile.PAX_FORMAT)
    # our reader takes the size from the ustar field or, from 8 GiB on, the PAX record
    member = next(iter_tar(io.BytesIO(header + b"\0" * min(size, 1024))))
    assert (member.name, member.size, member.isreg()) == (name, size, True)


def test_blob_digest_accepts_only_blob_members() -> None:
    digest = "0f" * 32
    assert blob_digest(blob_member(digest)) == digest
    for name in ["manifest.json", "blobs/" + "0F" * 32, "blobs/../x", "blobs/" + digest + "/"]:
        assert blob_digest(name) is None


def test_layout_writes_each_blob_once_in_order_and_ends_the_tar() -> None:
    pieces = list(layout(b"{}", [("a" * 64, 3), ("b" * 64, 512), ("a" * 64, 3)]))
    slots = [p for p in pieces if isinstance(p, BlobSlot)]
    assert slots == [BlobSlot("a" * 64, 3), BlobSlot("b" * 64, 512)]
    assert pieces[-1] == b"\0" * (2 * BLOCK)
    total = sum(p.size_bytes if isinstance(p, BlobSlot) else len(p) for p in pieces)
    # header + padded data for the manifest and each blob, then two zero blocks
    assert total == (2 + 2 + 2 + 2) * BLOCK


def test_write_tar_refuses_a_blob_shorter_than_declared() -> None:
    out = io.BytesIO()
    with pytest.raises(BlobMissing, match="short"):
        write_tar(
            out,
            manifest_json=b"{}",
            blobs=[("c" * 64, 10)],
            open_blob=lambda _d: io.BytesIO(b"12345"),
        )


def test_one_file_archive_and_server_stream_hold_the_same_tar(tmp_path: Path) -> None:
    """Both writers use the one format: same bytes inside the zstd, whatever the framing,
    and `zstd -d | tar -x` and our reader both read them."""
    big = bytes(range(256)) * 1024  # 256 KiB: passed through as its stored frame
    store, manifest = _store_with_files(
        tmp_path, {"a/small.py": b"print(1)\n", "b/dup.py": b"print(1)\n", "c/big.so": big}
    )
    archive = tmp_path / "one.tar.zst"
    write_archive(manifest, store.blobs, archive)
    one_file = zstandard.ZstdDecompressor().stream_reader(
        archive.read_bytes(), read_across_frames=True
    )
    streamed = b"".join(
        archive_chunks(
            manifest_json=manifest.to_json().encode(),
            blobs=[(f.digest, f.size_bytes) for f in manifest.files],
            store=store.blobs,
            splice_min_bytes=64 << 10,
        )
    )
    tar_bytes = one_file.read()
    assert (
        tar_bytes
        == zstandard.ZstdDecompressor().stream_reader(streamed, read_across_frames=True).read()
    )
    assert read_manifest_member(io.BytesIO(tar_bytes), source="t") == manifest
    names = [m.name for m in iter_tar(io.BytesIO(tar_bytes))]
    assert names == ["manifest.json"] + [
        blob_member(d) for d in dict.fromkeys(f.digest for f in manifest.files)
    ]
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(
        ["tar", "-x", "-C", str(out)],
        input=subprocess.run(
            ["zstd", "-dc"], input=streamed, capture_output=True, check=True
        ).stdout,
        check=True,
    )
    assert (out / "manifest.json").read_bytes() == manifest.to_json().encode()
    assert (out / blob_member(manifest.files[2].digest)).read_bytes() == big


def test_returns_exactly_the_source_bytes_for_any_read_sizes() -> None:
    rng = random.Random(7)
    data = rng.randbytes(3_000_123)
    reader = ReadAhead(io.BytesIO(data), chunk_bytes=65_536, depth=3)
    out = bytearray()
    while True:
        piece = reader.read(rng.choice([1, 511, 512, 70_000, 1 << 20]))
        if not piece:
            break
        out += piece
    assert bytes(out) == data
    assert reader.read(10) == b""


def test_read_all_and_errors_reach_the_reader() -> None:
    assert ReadAhead(io.BytesIO(b"abc" * 1000), chunk_bytes=7).read() == b"abc" * 1000

    class Broken(io.RawIOBase):
        calls = 0

        def read(self, size: int = -1) -> bytes:
            self.calls += 1
            if self.calls > 2:
                raise ConnectionResetError("cut off mid-stream")
            return b"x" * size

    reader = ReadAhead(Broken(), chunk_bytes=4)  # type: ignore[arg-type]
    assert reader.read(8) == b"x" * 8
    with pytest.raises(ConnectionResetError, match="cut off"):
        reader.read(8)
