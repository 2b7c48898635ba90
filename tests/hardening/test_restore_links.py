"""The restore against a hostile target dir: links planted above snapshot files (never
written through, at any depth, also when planted mid-restore), and a planted Triton group
file under a trusted restore (reported, never recorded as trusted). Real files."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from cachekeeper.manifest import FileEntry, Manifest
from cachekeeper.restore import is_restored, restore, restore_archive
from cachekeeper.signing import generate_keypair, load_public_key, sign_manifest
from cachekeeper.snapshot import snapshot_dir, write_archive
from cachekeeper.store import LocalStore
from tests.hardening.conftest import child_env, cli, sha

FP = {"schema": 1, "torch": "test"}


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(home=tmp_path / "home")


def _cache(root: Path) -> Path:
    files = {
        "fxgraph/ab/key1/entry": b"graph" * 1000,
        "fxgraph/cd/key2/entry": b"graph two" * 100,
        "ab/cabc.py": b"print('hi')\n",
        "cd/big.so": os.urandom(1 << 20),
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


@pytest.fixture
def archive(store: LocalStore, tmp_path: Path) -> Path:
    manifest = snapshot_dir(_cache(tmp_path / "src"), store=store, fingerprint=FP)
    out = tmp_path / "snap.tar.zst"
    write_archive(manifest, store.blobs, out)
    return out


def _one_line_error(proc: subprocess.CompletedProcess[str], code: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert lines[0].endswith(f"[{code}]"), lines[0]
    return lines[0]


def _restore_cli(archive: Path, cache_dir: Path, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli("restore", str(archive), "--cache-dir", str(cache_dir), "--json"),
        env=child_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- 18.6: links the restore did not create ----------------------------------------------
@pytest.mark.parametrize(
    ("link", "below"),
    [
        ("fxgraph", ["fxgraph/ab/key1/entry", "fxgraph/cd/key2/entry"]),
        ("fxgraph/ab", ["fxgraph/ab/key1/entry"]),
        ("fxgraph/ab/key1", ["fxgraph/ab/key1/entry"]),
    ],
    ids=["depth-1", "depth-2", "depth-3"],
)
def test_a_planted_link_above_files_is_never_written_through(
    archive: Path, tmp_path: Path, link: str, below: list[str], reliability
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "theirs.txt").write_bytes(b"not ours")
    dst = tmp_path / "dst"
    (dst / link).parent.mkdir(parents=True, exist_ok=True)
    (dst / link).symlink_to(outside, target_is_directory=True)
    planned = restore_archive(archive, dst, dry_run=True)
    report = restore_archive(archive, dst)
    assert sorted(os.listdir(outside)) == ["theirs.txt"]  # not one byte written there
    assert report.conflicts == below == planned.conflicts
    assert (dst / link).is_symlink()
    assert not is_restored(report.snapshot_id, dst)  # incomplete: no marker
    assert report.written == 4 - len(below)
    reliability.record(
        f"a link planted at `{link}` (depth {link.count('/') + 1}) to a folder outside: "
        "every file below it reported as a conflict, nothing written outside, no marker",
        tries=1,
        outcome="kept",
        area="planted links",
    )


def test_a_folder_swapped_for_a_link_mid_restore_is_not_followed(
    tmp_path: Path, reliability
) -> None:
    files = {"x/a": b"snapshot's a", "y/b": b"snapshot's b"}
    entries = [FileEntry(p, sha(d), len(d), 0o644) for p, d in files.items()]
    manifest = Manifest(files=tuple(entries), fingerprint=FP)
    dst, outside = tmp_path / "dst", tmp_path / "outside"
    outside.mkdir()

    class SwappingSource:
        """Plants ``dst/x`` as a link after the restore planned, before it publishes."""

        def open(self, digest: str) -> io.BytesIO:
            if not os.path.lexists(dst / "x"):
                (dst / "x").symlink_to(outside, target_is_directory=True)
            return io.BytesIO({sha(d): d for d in files.values()}[digest])

    report = restore(manifest, SwappingSource(), dst)
    assert os.listdir(outside) == []
    assert report.conflicts == ["x/a"]
    assert (dst / "y" / "b").read_bytes() == b"snapshot's b"
    reliability.record(
        "a folder of the snapshot planted as a link to outside after planning, before "
        "publishing: not followed, reported as a conflict",
        tries=1,
        outcome="kept",
        area="planted links",
    )


def _triton_cache(root: Path) -> None:
    folder = root / "triton" / "0" / "HASH"
    folder.mkdir(parents=True)
    children = {}
    for name in ("k.cubin", "k.json"):
        (folder / name).write_bytes(b"kernel " + name.encode())
        children[name] = str((folder / name).absolute())
    (folder / "__grp__k.json").write_text(json.dumps({"child_paths": children}))


def test_trusted_restore_reports_a_planted_group_file_and_records_no_trust(
    store: LocalStore, tmp_path: Path, reliability
) -> None:
    key, pub, key_id = generate_keypair(tmp_path / "builder")
    trusted = [load_public_key(pub)]
    manifest = sign_manifest(
        snapshot_dir(_triton_cache_dir(tmp_path), store=store, fingerprint=FP), key
    )
    dst = tmp_path / "dst"
    group = dst / "triton/0/HASH/__grp__k.json"
    group.parent.mkdir(parents=True)
    planted = {
        "child_paths": {
            "k.cubin": str(dst.absolute() / "triton/0/HASH/k.cubin"),
            "k.json": "/somewhere/else/entirely/k.json",
        }
    }
    group.write_text(json.dumps(planted))
    report = restore(manifest, store.blobs, dst, trusted_keys=trusted)
    assert report.conflicts == ["triton/0/HASH/__grp__k.json"]
    assert json.loads(group.read_text()) == planted  # kept as it was, and reported
    assert not is_restored(manifest.id, dst, trusted_key_ids={key_id})
    assert not is_restored(manifest.id, dst)

    # the group file a trusted restore itself wrote counts as present on a re-restore
    clean = tmp_path / "clean"
    first = restore(manifest, store.blobs, clean, trusted_keys=trusted)
    again = restore(manifest, store.blobs, clean, trusted_keys=trusted)
    assert (first.conflicts, again.conflicts, again.written, again.skipped) == ([], [], 0, 3)
    assert is_restored(manifest.id, clean, trusted_key_ids={key_id})
    reliability.record(
        "trusted restore into a dir with a planted Triton group file pointing outside: "
        "reported as a conflict, no trusted marker",
        tries=1,
        outcome="kept",
        area="planted links",
    )


def _triton_cache_dir(tmp_path: Path) -> Path:
    root = tmp_path / "triton-src"
    _triton_cache(root)
    return root
