"""Snapshots of real dirs: exclusions, refusals, the archive form, and a round-trip property."""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachekeeper.environment import cpu
from cachekeeper.environment.fingerprint import collect
from cachekeeper.errors import LinkInCacheDir
from cachekeeper.restore import restore, restore_archive
from cachekeeper.snapshot.make import (
    read_archive_manifest,
    scan_dir,
    snapshot_dir,
    write_archive,
)
from cachekeeper.snapshot.provenance import record_prewarm
from cachekeeper.store import LocalStore

FP = {"schema": 1, "torch": "test", "gpus": []}


def write(root: Path, rel: str, data: bytes = b"x") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_scan_excludes_locks_temp_and_state(tmp_path: Path) -> None:
    for rel in [
        "fxgraph/ab/key/entry",
        "locks/abc.lock",
        "triton/0/h/k.lock",
        "ab/c.py.tmp",
        "ab/c.partial",
        "ab/.hidden",
        ".cachekeeper/restored/x",
        ".cachekeeper/staging/h-1-0123abcd/f",
        "ab/c.py",
    ]:
        write(tmp_path, rel)
    os.mkfifo(tmp_path / "ab" / "fifo")
    assert [rel for rel, _, _ in scan_dir(tmp_path)] == ["ab/c.py", "fxgraph/ab/key/entry"]


def test_link_in_cache_dir_is_refused_naming_it(tmp_path: Path) -> None:
    write(tmp_path, "ab/c.py")
    (tmp_path / "ab" / "link.py").symlink_to(tmp_path / "ab" / "c.py")
    with pytest.raises(LinkInCacheDir, match="ab/link.py"):
        scan_dir(tmp_path)


def test_linked_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    write(outside, "secret")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "triton").symlink_to(outside)
    with pytest.raises(LinkInCacheDir, match="triton"):
        scan_dir(cache)


def test_snapshot_dedups_blobs_and_records_modes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src, "a", b"same")
    write(src, "b/c", b"same")
    write(src, "run.so", b"elf")
    os.chmod(src / "run.so", 0o755)
    store = LocalStore(home=tmp_path / "home")
    manifest = snapshot_dir(src, store=store, fingerprint=FP, workload="w")
    assert [f.path for f in manifest.files] == ["a", "b/c", "run.so"]
    assert {f.path: f.mode for f in manifest.files}["run.so"] == 0o755
    assert len(list(store.blobs.digests())) == 2
    assert manifest.devices == ("cpu",)
    assert store.load_manifest(manifest.id) == manifest
    # the same dir again: same id, nothing new stored
    assert snapshot_dir(src, store=store, fingerprint=FP, workload="w").id == manifest.id


def test_the_prewarm_records_cpu_state_wins_over_any_fingerprint_passed_in(
    tmp_path: Path,
) -> None:
    """One fingerprint per snapshot, the one its caches were built with (issue 25): the
    agent and push pass the caller's fingerprint, whose thread count is the shell's; the
    children compiled with the workload's [process] omp_num_threads, recorded by prewarm."""
    src = tmp_path / "src"
    write(src, "fxgraph/ab/k/entry", b"graph")
    caller = collect(environ={"OMP_NUM_THREADS": "2"})
    children = cpu.with_threads(caller["cpu"], 1)
    stats = {"verify": {"effective": True}}
    record_prewarm(src, workload="w", workload_digest="d" * 64, devices=["cpu"], stats=stats,
                   cpu=children)  # fmt: skip
    store = LocalStore(home=tmp_path / "home")
    for passed in (caller, None):
        manifest = snapshot_dir(src, store=store, fingerprint=passed, workload="w")
        assert manifest.fingerprint["cpu"] == children and manifest.verified
        assert manifest.fingerprint == {**(passed or collect()), "cpu": children}
    # no record (someone's own cache): the fingerprint passed in, as it is
    other = tmp_path / "other"
    write(other, "a", b"x")
    assert snapshot_dir(other, store=store, fingerprint=caller).fingerprint == caller


def test_devices_follow_triton_index_folders_on_gpu_builders(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src, "triton/0/h/k.cubin")
    write(src, "triton/3/h/k.cubin")
    fp = {**FP, "gpus": [{"index": i, "name": "H200", "capability": "9.0"} for i in range(4)]}
    manifest = snapshot_dir(src, store=LocalStore(home=tmp_path / "h"), fingerprint=fp)
    assert manifest.devices == ("cuda:0", "cuda:3")


def test_archive_layout_manifest_first_then_each_blob_once(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src, "a", b"same")
    write(src, "b", b"same")
    write(src, "c", b"other")
    store = LocalStore(home=tmp_path / "home")
    manifest = snapshot_dir(src, store=store, fingerprint=FP)
    out = tmp_path / "snap.tar.zst"
    size = write_archive(manifest, store.blobs, out)
    assert size == out.stat().st_size
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    with open(out, "rb") as fh:
        reader = zstandard.ZstdDecompressor().stream_reader(fh)
        names = [m.name for m in tarfile.open(fileobj=reader, mode="r|")]
    assert names[0] == "manifest.json"
    assert sorted(names[1:]) == sorted(f"blobs/{d}" for d in manifest.digests)
    assert read_archive_manifest(out) == manifest


_names = st.text(alphabet="abcxyz019_-", min_size=1, max_size=8)
_trees = st.dictionaries(
    keys=st.lists(_names, min_size=1, max_size=3).map("/".join),
    values=st.binary(max_size=3000),
    max_size=12,
)


def _valid_tree(files: dict[str, bytes]) -> dict[str, bytes]:
    """Drop paths that are also a folder of another path (a tree cannot hold both)."""
    folders = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
    return {p: d for p, d in files.items() if p not in folders}


@pytest.mark.slow  # hypothesis: many trees
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=_trees, via_archive=st.booleans())
def test_snapshot_restore_round_trips_any_tree(files: dict[str, bytes], via_archive: bool) -> None:
    files = _valid_tree(files)
    work = Path(tempfile.mkdtemp(prefix="ck-prop-"))
    try:
        src = work / "src"
        src.mkdir()
        for rel, data in files.items():
            write(src, rel, data)
        store = LocalStore(home=work / "home")
        manifest = snapshot_dir(src, store=store, fingerprint=FP)
        dst = work / "dst"
        if via_archive:
            write_archive(manifest, store.blobs, work / "a.tar.zst")
            report = restore_archive(work / "a.tar.zst", dst)
        else:
            report = restore(manifest, store.blobs, dst)
        assert report.written == len(files) and report.conflicts == []
        restored = {
            p.relative_to(dst).as_posix(): p.read_bytes()
            for p in dst.rglob("*")
            if p.is_file() and not p.relative_to(dst).as_posix().startswith(".cachekeeper")
        }
        assert restored == files
    finally:
        shutil.rmtree(work)


def test_a_signature_is_refused_for_a_dir_holding_restored_files(tmp_path: Path) -> None:
    """A signature vouches that the signer compiled what it signs (issue 32): a dir that
    a restore of a snapshot filled is refused, one that prewarm's merges filled is not."""
    from cachekeeper.errors import NotOwnBytes
    from cachekeeper.restore import merge_tree
    from cachekeeper.snapshot.signing import generate_keypair

    key, _pub, _ = generate_keypair(tmp_path / "keys" / "builder")
    src = tmp_path / "compiled"
    for i in range(3):
        (src / "fxgraph" / f"a{i}").mkdir(parents=True)
        (src / "fxgraph" / f"a{i}" / "entry").write_bytes(f"graph {i}".encode())
    store = LocalStore(home=tmp_path / "home")
    merged = tmp_path / "merged"
    merge_tree(src, merged)  # what prewarm does with its staging dirs
    assert snapshot_dir(merged, store=store, sign_key=key).signature is not None

    restored = tmp_path / "restored"
    restore(snapshot_dir(src, store=store), store.blobs, restored)
    with pytest.raises(NotOwnBytes, match="refusing to sign .* restored from snapshot"):
        snapshot_dir(restored, store=store, sign_key=key)
    assert snapshot_dir(restored, store=store).signature is None  # unsigned: as before
    (restored / "fxgraph" / "new").mkdir()
    (restored / "fxgraph" / "new" / "entry").write_bytes(b"what the job compiled")
    harvest = snapshot_dir(
        restored, store=store, sign_key=key, only=["fxgraph/new/entry"], parent="a" * 64
    )
    assert harvest.source == "harvest" and harvest.signature is not None  # the node's key
