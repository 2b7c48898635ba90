"""Restore rules (DESIGN section 5), each against real files and real archives."""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import tarfile
import threading
from pathlib import Path

import pytest
import zstandard

from cachekeeper.errors import (
    BlobMissing,
    BlobTooLarge,
    DigestMismatch,
    InvalidManifest,
    UnsafePath,
    UnsupportedFormat,
)
from cachekeeper.restore import (
    is_restored,
    merge_tree,
    needed_digests,
    restore,
    restore_archive,
    restore_from_tar,
    target_lock,
)
from cachekeeper.snapshot.make import snapshot_dir, write_archive
from cachekeeper.snapshot.manifest import FileEntry, Manifest
from cachekeeper.store import LocalStore
from tests.helpers.triton import make_triton_cache

FP = {"schema": 1, "torch": "test"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_of(files: dict[str, bytes]) -> Manifest:
    entries = [FileEntry(p, sha(d), len(d), 0o644) for p, d in files.items()]
    return Manifest(files=tuple(entries), fingerprint=FP, devices=("cpu",))


def crafted_archive(
    out: Path, manifest_json: bytes | None, members: list[tuple[tarfile.TarInfo, bytes]]
) -> Path:
    """An archive written by hand, so that it can hold what write_archive never would."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if manifest_json is not None:
            info = tarfile.TarInfo("manifest.json")
            info.size = len(manifest_json)
            tar.addfile(info, io.BytesIO(manifest_json))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    out.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    return out


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def tree(root: Path) -> dict[str, bytes]:
    """Every visible file under root (the .cachekeeper state folder left out)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".cachekeeper") or not path.is_file():
            continue
        out[rel] = path.read_bytes()
    return out


def staging_leftovers(root: Path) -> list[Path]:
    staging = root / ".cachekeeper" / "staging"
    return list(staging.rglob("*")) if staging.exists() else []


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(home=tmp_path / "home")


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    files = {
        "fxgraph/ab/key1/entry": b"graph" * 1000,
        "ab/cabc.py": b"print('hi')\n",
        "ab/same.py": b"print('hi')\n",  # same blob as cabc.py
        "cd/big.so": os.urandom(3 << 20),
        "empty.json": b"",
    }
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    os.chmod(src / "cd" / "big.so", 0o755)
    return src


@pytest.fixture
def sample_archive(sample: Path, store: LocalStore, tmp_path: Path) -> Path:
    manifest = snapshot_dir(sample, store=store, fingerprint=FP)
    out = tmp_path / "snap.tar.zst"
    write_archive(manifest, store.blobs, out)
    return out


def test_archive_restore_reproduces_the_tree_and_modes(
    sample: Path, sample_archive: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "elsewhere" / "cache"
    report = restore_archive(sample_archive, dst)
    assert tree(dst) == tree(sample)
    assert report.written == 5 and report.skipped == 0 and report.conflicts == []
    assert report.bytes_written == sum(len(d) for d in tree(sample).values())
    assert (dst / "cd" / "big.so").stat().st_mode & 0o777 == 0o755
    assert staging_leftovers(dst) == []


def test_rerestore_skips_everything(sample_archive: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    restore_archive(sample_archive, dst)
    again = restore_archive(sample_archive, dst)
    assert (again.written, again.skipped, again.conflicts) == (0, 5, [])


def test_restore_from_store_blobs(sample: Path, store: LocalStore, tmp_path: Path) -> None:
    manifest = snapshot_dir(sample, store=store, fingerprint=FP)
    dst = tmp_path / "dst"
    report = restore(manifest, store.blobs, dst)
    assert report.written == 5
    assert tree(dst) == tree(sample)


def test_never_truncates_and_reports_conflicts(sample_archive: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    (dst / "ab").mkdir(parents=True)
    (dst / "ab" / "cabc.py").write_bytes(b"mine, different and longer than the snapshot's")
    (dst / "unrelated.txt").write_bytes(b"not in the snapshot")
    (dst / "cd").mkdir()
    (dst / "cd" / "big.so").symlink_to(dst / "unrelated.txt")
    report = restore_archive(sample_archive, dst)
    assert report.conflicts == ["ab/cabc.py", "cd/big.so"]
    assert (
        dst / "ab" / "cabc.py"
    ).read_bytes() == b"mine, different and longer than the snapshot's"
    assert (dst / "unrelated.txt").read_bytes() == b"not in the snapshot"
    assert (dst / "cd" / "big.so").is_symlink()
    assert report.written == 3
    # with conflicts the restore is not recorded as complete
    assert not is_restored(report.snapshot_id, dst)


def _archive_of(files: dict[str, bytes], store: LocalStore, where: Path) -> Path:
    src = where / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    out = where / "snap.tar.zst"
    write_archive(snapshot_dir(src, store=store, fingerprint=FP), store.blobs, out)
    return out


def test_a_path_another_restore_wrote_is_shared_not_a_conflict(
    store: LocalStore, tmp_path: Path
) -> None:
    # Issue 31: two workloads' snapshots both hold one C++ kernel (same path: its source
    # hash), compiled twice into other bytes. Restored into one per-environment dir, the
    # second restore used to keep the first's file as a conflict, write no marker, and
    # warn on every job start ("check who changed them") though nobody changed anything.
    a = _archive_of({"th/kernel.so": b"built by a", "fxgraph/a/e": b"a"}, store, tmp_path / "a")
    b = _archive_of({"th/kernel.so": b"built by b!", "fxgraph/b/e": b"b"}, store, tmp_path / "b")
    dst = tmp_path / "dst"
    first = restore_archive(a, dst)
    second = restore_archive(b, dst)
    assert second.conflicts == [] and second.shared == {"th/kernel.so": first.snapshot_id}
    assert (dst / "th" / "kernel.so").read_bytes() == b"built by a"  # kept as it was
    assert (dst / "fxgraph" / "b" / "e").read_bytes() == b"b"
    assert is_restored(second.snapshot_id, dst) and is_restored(first.snapshot_id, dst)
    assert json.loads(json.dumps(second.to_dict()))["shared"] == second.shared

    # a change nobody cachekeeper-made explains is still a conflict, and still said
    os.utime(dst / "th" / "kernel.so", ns=(1, 1))
    third = restore_archive(b, dst)
    assert third.conflicts == ["th/kernel.so"] and third.shared == {}
    assert not is_restored(third.snapshot_id, dst)


def test_dry_run_writes_nothing(sample_archive: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    report = restore_archive(sample_archive, dst, dry_run=True)
    assert report.dry_run and report.written == 0
    assert sorted(report.planned) == sorted(
        ["ab/cabc.py", "ab/same.py", "cd/big.so", "empty.json", "fxgraph/ab/key1/entry"]
    )
    assert not dst.exists()


def test_is_restored_and_needed_digests(sample: Path, sample_archive: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    from cachekeeper.snapshot.make import read_archive_manifest

    manifest = read_archive_manifest(sample_archive)
    assert needed_digests(manifest, dst) == manifest.digests
    assert not is_restored(manifest.id, dst)
    restore_archive(sample_archive, dst)
    assert is_restored(manifest.id, dst)
    assert needed_digests(manifest, dst) == set()
    (dst / "empty.json").unlink()
    assert not is_restored(manifest.id, dst)
    assert needed_digests(manifest, dst) == {sha(b"")}


# -- refusals: nothing is written -----------------------------------------------------------
def _ok_manifest_json(files: dict[str, bytes]) -> bytes:
    return manifest_of(files).to_json().encode()


def _bad_manifest_json(path: str) -> bytes:
    body = manifest_of({"a": b"x"}).to_dict()
    body["files"][0]["path"] = path
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("manifest_json", "error"),
    [
        (_bad_manifest_json("../escape"), UnsafePath),
        (_bad_manifest_json("/etc/passwd"), UnsafePath),
        (_bad_manifest_json("a/../../b"), UnsafePath),
        (_bad_manifest_json(".cachekeeper/lock"), UnsafePath),
        (
            json.dumps(
                {
                    **manifest_of({"a": b"x"}).to_dict(),
                    "files": [manifest_of({"a": b"x"}).files[0].to_dict()] * 2,
                }
            ).encode(),
            InvalidManifest,
        ),
        (
            json.dumps({**manifest_of({"a": b"x"}).to_dict(), "format": 99}).encode(),
            UnsupportedFormat,
        ),
    ],
    ids=["dotdot", "absolute", "nested-dotdot", "own-state-dir", "duplicate", "unknown-format"],
)
def test_bad_manifest_is_refused_before_writing(
    tmp_path: Path, manifest_json: bytes, error: type[Exception]
) -> None:
    archive = crafted_archive(
        tmp_path / "bad.tar.zst", manifest_json, [reg(f"blobs/{sha(b'x')}", b"x")]
    )
    dst = tmp_path / "dst"
    with pytest.raises(error):
        restore_archive(archive, dst)
    assert not dst.exists()


def _link_member(kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(f"blobs/{sha(b'x')}")
    info.type = kind
    info.linkname = "/etc/passwd"
    return info, b""


@pytest.mark.parametrize(
    ("member", "error"),
    [
        (_link_member(tarfile.SYMTYPE), UnsafePath),
        (_link_member(tarfile.LNKTYPE), UnsafePath),
        (_link_member(tarfile.CHRTYPE), UnsafePath),
        (reg("../../escape", b"x"), UnsafePath),
        (reg("/abs/path", b"x"), UnsafePath),
        (reg(f"blobs/{sha(b'other')}", b"other"), InvalidManifest),
        (reg(f"blobs/{sha(b'x')}", b"y"), DigestMismatch),
        (reg(f"blobs/{sha(b'x')}", b"xx"), BlobTooLarge),
    ],
    ids=[
        "symlink",
        "hardlink",
        "device",
        "traversal",
        "absolute",
        "unknown-blob",
        "corrupt",
        "too-large",
    ],
)
def test_bad_members_are_refused_before_writing(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes], error: type[Exception]
) -> None:
    files = {"a": b"x"}
    archive = crafted_archive(tmp_path / "bad.tar.zst", _ok_manifest_json(files), [member])
    dst = tmp_path / "dst"
    with pytest.raises(error):
        restore_archive(archive, dst)
    assert tree(dst) == {}
    assert staging_leftovers(dst) == []


def test_missing_blob_is_refused_naming_the_entry(tmp_path: Path) -> None:
    archive = crafted_archive(tmp_path / "bad.tar.zst", _ok_manifest_json({"dir/a": b"x"}), [])
    dst = tmp_path / "dst"
    with pytest.raises(BlobMissing, match="dir/a"):
        restore_archive(archive, dst)
    assert tree(dst) == {}


def test_decompression_bomb_is_cut_off_at_the_declared_size(tmp_path: Path) -> None:
    """A tiny zstd frame that expands to 256 MiB under a blob declared as 1 byte."""
    bomb = 256 << 20
    files = {"a": b"x"}
    header = tarfile.TarInfo(f"blobs/{sha(b'x')}")
    header.size = bomb
    manifest_json = _ok_manifest_json(files)
    info = tarfile.TarInfo("manifest.json")
    info.size = len(manifest_json)
    padding = b"\0" * ((-len(manifest_json)) % 512)
    head = info.tobuf(format=tarfile.PAX_FORMAT) + manifest_json + padding
    cctx = zstandard.ZstdCompressor(level=19)
    chunks = cctx.compressobj()
    data = chunks.compress(head + header.tobuf(format=tarfile.PAX_FORMAT))
    zeros = bytes(1 << 20)
    for _ in range(bomb >> 20):
        data += chunks.compress(zeros)
    data += chunks.flush()
    archive = tmp_path / "bomb.tar.zst"
    archive.write_bytes(data)
    assert archive.stat().st_size < 100_000
    dst = tmp_path / "dst"
    with pytest.raises(BlobTooLarge, match="a"):
        restore_archive(archive, dst)
    assert tree(dst) == {}


def test_not_an_archive_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.tar.zst"
    bogus.write_bytes(b"this is not zstd")
    with pytest.raises(UnsupportedFormat):
        restore_archive(bogus, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_corrupt_blob_keeps_only_verified_files_and_a_rerun_completes(tmp_path: Path) -> None:
    good, bad = b"good" * 100, b"bad!" * 100
    files = {"a/good": good, "b/bad": bad}
    members = [reg(f"blobs/{sha(good)}", good), reg(f"blobs/{sha(bad)}", b"evil" * 100)]
    archive = crafted_archive(tmp_path / "bad.tar.zst", _ok_manifest_json(files), members)
    dst = tmp_path / "dst"
    with pytest.raises(DigestMismatch, match="b/bad"):
        restore_archive(archive, dst)
    assert tree(dst) == {"a/good": good}
    assert staging_leftovers(dst) == []
    fixed = crafted_archive(
        tmp_path / "ok.tar.zst",
        _ok_manifest_json(files),
        [reg(f"blobs/{sha(good)}", good), reg(f"blobs/{sha(bad)}", bad)],
    )
    report = restore_archive(fixed, dst)
    assert (report.written, report.skipped) == (1, 1)
    assert tree(dst) == files


class _FailingSource:
    """A blob source that breaks after ``limit`` blobs (a dropped connection)."""

    def __init__(self, blobs: dict[str, bytes], limit: int) -> None:
        self.blobs, self.limit, self.opened = blobs, limit, 0

    def open(self, digest: str) -> io.BytesIO:
        self.opened += 1
        if self.opened > self.limit:
            raise ConnectionResetError("connection reset by peer")
        return io.BytesIO(self.blobs[digest])


def test_interrupted_restore_leaves_no_partial_file_and_rerun_completes(tmp_path: Path) -> None:
    files = {f"d{i}/f{i}": os.urandom(10_000 + i) for i in range(10)}
    manifest = manifest_of(files)
    blobs = {sha(d): d for d in files.values()}
    dst = tmp_path / "dst"
    with pytest.raises(ConnectionResetError):
        restore(manifest, _FailingSource(blobs, 4), dst)
    partial = tree(dst)
    assert len(partial) == 4
    assert all(files[p] == d for p, d in partial.items())
    assert staging_leftovers(dst) == []
    report = restore(manifest, _FailingSource(blobs, 100), dst)
    assert (report.written, report.skipped) == (6, 4)
    assert tree(dst) == files


def test_stale_staging_of_dead_process_is_removed_and_nothing_else(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    dst = tmp_path / "dst"
    staging = dst / ".cachekeeper" / "staging"
    stale = staging / f"{socket.gethostname()}-{pid}-0123abcd"
    stale.mkdir(parents=True)
    (stale / "half-written").write_bytes(b"partial")
    alive = staging / f"{socket.gethostname()}-{os.getpid()}-0123abcd"
    alive.mkdir()
    foreign = staging / "not-ours"
    foreign.mkdir()
    restore(manifest_of({"f": b"data"}), _FailingSource({sha(b"data"): b"data"}, 10), dst)
    assert not stale.exists()
    assert alive.exists() and foreign.exists()


def test_race_with_another_writer_never_clobbers(tmp_path: Path) -> None:
    """A file created between planning and publishing is kept (link fails with EEXIST)."""
    files = {"x/a": b"snapshot's a", "x/b": b"snapshot's b"}
    dst = tmp_path / "dst"

    class RacingSource:
        def open(self, digest: str) -> io.BytesIO:
            (dst / "x").mkdir(parents=True, exist_ok=True)
            if not (dst / "x" / "b").exists():
                (dst / "x" / "b").write_bytes(b"someone else's b")
            return io.BytesIO({sha(d): d for d in files.values()}[digest])

    report = restore(manifest_of(files), RacingSource(), dst)
    assert (dst / "x" / "b").read_bytes() == b"someone else's b"
    assert report.conflicts == ["x/b"]
    assert (dst / "x" / "a").read_bytes() == b"snapshot's a"


# -- concurrency ----------------------------------------------------------------------------
def _restore_in_child(archive: str, dst: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    report = restore_archive(Path(archive), Path(dst))
    queue.put((report.written, report.skipped, len(report.conflicts)))


@pytest.mark.slow  # eight processes
def test_eight_concurrent_restores_serialize_and_reuse(
    sample_archive: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "shared"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_restore_in_child, args=(str(sample_archive), str(dst), queue))
        for _ in range(8)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    results = [queue.get(timeout=5) for _ in procs]
    assert sum(w for w, _, _ in results) == 5  # each file written exactly once
    assert sorted(results)[-1] == (5, 0, 0)
    assert sorted(results)[:7] == [(0, 5, 0)] * 7
    assert staging_leftovers(dst) == []


def test_restore_takes_the_lock_once_and_waits_for_another_holder(tmp_path: Path) -> None:
    """The lock is not re-entrant: one restore takes it once; a holder in another thread
    makes it wait (it would deadlock if the restore took it twice, or skip it if not at all).
    """
    source = _FailingSource({sha(b"1"): b"1"}, 5)
    done: list[int] = []

    def run() -> None:
        done.append(restore(manifest_of({"f": b"1"}), source, tmp_path).written)

    with target_lock(tmp_path):
        worker = threading.Thread(target=run)
        worker.start()
        worker.join(0.5)
        assert source.opened == 0  # still waiting for the lock
    worker.join(60)
    assert done == [1]


# -- Triton group files ---------------------------------------------------------------------
def test_triton_group_paths_are_rewritten_to_the_new_root(
    store: LocalStore, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    make_triton_cache(src, outside_child="/not/in/the/cache/file")
    manifest = snapshot_dir(src, store=store, fingerprint=FP)
    dst = tmp_path / "moved" / "cache"
    report = restore(manifest, store.blobs, dst)
    assert report.conflicts == []
    group = json.loads((dst / "triton/0/HASH/__grp__k.json").read_text())["child_paths"]
    assert group["k.cubin"] == str(dst.absolute() / "triton/0/HASH/k.cubin")
    assert group["k.json"] == str(dst.absolute() / "triton/0/HASH/k.json")
    assert group["elsewhere"] == "/not/in/the/cache/file"
    assert Path(group["k.cubin"]).read_bytes() == b"kernel k.cubin"
    # a re-restore treats the rewritten group file as present, not as a conflict
    again = restore(manifest, store.blobs, dst)
    assert (again.written, again.skipped, again.conflicts) == (0, 3, [])
    assert is_restored(manifest.id, dst)


def test_merge_tree_follows_the_same_rules(tmp_path: Path) -> None:
    src, dst = tmp_path / "staging-cache", tmp_path / "cache"
    make_triton_cache(src, outside_child="/not/in/the/cache/file")
    (src / "ab").mkdir()
    (src / "ab" / "x.py").write_bytes(b"new")
    (dst / "ab").mkdir(parents=True)
    (dst / "ab" / "x.py").write_bytes(b"old")
    report = merge_tree(src, dst)
    assert report.conflicts == ["ab/x.py"]
    assert (dst / "ab" / "x.py").read_bytes() == b"old"
    group = json.loads((dst / "triton/0/HASH/__grp__k.json").read_text())["child_paths"]
    assert group["k.cubin"].startswith(str(dst.absolute()))


class _PipeLike:
    """A non-seekable byte stream, like an HTTP response body."""

    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._buf.read(min(n, 4096) if n > 0 else 4096)

    def seekable(self) -> bool:
        return False


def test_restore_from_tar_reads_a_non_seekable_stream(
    sample: Path, sample_archive: Path, tmp_path: Path
) -> None:
    from cachekeeper.snapshot.make import read_archive_manifest

    manifest = read_archive_manifest(sample_archive)
    plain = zstandard.ZstdDecompressor().decompressobj().decompress(sample_archive.read_bytes())
    dst = tmp_path / "dst"
    report = restore_from_tar(manifest, _PipeLike(plain), dst)  # type: ignore[arg-type]
    assert report.written == 5
    assert tree(dst) == tree(sample)


def test_stream_ending_inside_a_member_is_a_digest_mismatch(tmp_path: Path) -> None:
    """A well-formed zstd stream whose tar stops mid-blob (a cut-off download that ended
    cleanly) is a retryable DigestMismatch naming the file, never a raw ValueError."""
    data = b"z" * 4096
    files = {"a/cut": data}
    manifest_json = _ok_manifest_json(files)
    info = tarfile.TarInfo("manifest.json")
    info.size = len(manifest_json)
    head = info.tobuf(format=tarfile.PAX_FORMAT) + manifest_json
    head += b"\0" * ((-len(manifest_json)) % 512)
    blob_info = tarfile.TarInfo(f"blobs/{sha(data)}")
    blob_info.size = len(data)
    cut = head + blob_info.tobuf(format=tarfile.PAX_FORMAT) + data[:1000]
    archive = tmp_path / "cut.tar.zst"
    archive.write_bytes(zstandard.ZstdCompressor().compress(cut))
    dst = tmp_path / "dst"
    with pytest.raises(DigestMismatch, match="a/cut"):
        restore_archive(archive, dst)
    assert tree(dst) == {}
    assert staging_leftovers(dst) == []
