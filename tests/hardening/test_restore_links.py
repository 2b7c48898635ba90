"""The restore against a hostile or broken target dir: links planted above snapshot files
(never written through, at any depth, also when planted mid-restore), a planted Triton
group file under a trusted restore (reported, never recorded as trusted), and the target
filesystem refusing (full, a name too long, our state folder a file or a link): one-line
errors, never a traceback. Real files, real CLI processes, a real tmpfs where the disk
must fill up."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import httpx
import pytest
import zstandard

from cachekeeper.errors import UnsafePath
from cachekeeper.fingerprint import collect
from cachekeeper.manifest import FileEntry, Manifest
from cachekeeper.restore import is_restored, restore, restore_archive
from cachekeeper.server.settings import Settings
from cachekeeper.signing import generate_keypair, load_public_key, sign_manifest
from cachekeeper.snapshot import snapshot_dir, write_archive
from cachekeeper.store import LocalStore
from tests.hardening.conftest import child_env, cli, sha, visible_files
from tests.helpers.live_server import start_server
from tests.helpers.triton import make_triton_cache

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
    # this node's own fingerprint: `cachekeeper restore` refuses another environment's
    manifest = snapshot_dir(_cache(tmp_path / "src"), store=store, fingerprint=collect())
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
    make_triton_cache(root)
    return root


# -- 18.7: the target refuses: one line, never a traceback --------------------------------
def test_state_folder_that_is_a_file_or_a_link_is_refused_in_one_line(
    archive: Path, tmp_path: Path, reliability
) -> None:
    as_file = tmp_path / "as-file"
    as_file.mkdir()
    (as_file / ".cachekeeper").write_bytes(b"someone's file")
    line = _one_line_error(_restore_cli(archive, as_file, tmp_path / "home"), "cache_dir_unusable")
    assert ".cachekeeper" in line
    assert (as_file / ".cachekeeper").read_bytes() == b"someone's file"
    assert visible_files(as_file) == {}

    outside = tmp_path / "outside"
    outside.mkdir()
    as_link = tmp_path / "as-link"
    as_link.mkdir()
    (as_link / ".cachekeeper").symlink_to(outside, target_is_directory=True)
    _one_line_error(_restore_cli(archive, as_link, tmp_path / "home"), "cache_dir_unusable")
    assert os.listdir(outside) == []  # no lock, staging or marker written through it
    assert visible_files(as_link) == {}
    reliability.record(
        "`restore` with the cache dir's `.cachekeeper` a regular file, or a link to outside: "
        "one-line error, nothing written",
        tries=2,
        outcome="refused",
        area="target dir",
    )


def _long_name_archive(out: Path) -> Path:
    """An archive whose manifest names a path component of 256 bytes (ext4 allows 255)."""
    data = b"kernel"
    body = Manifest(files=(FileEntry("ab/short", sha(data), len(data)),), fingerprint=FP).to_dict()
    body["files"][0]["path"] = "ab/" + "k" * 256
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, payload in (
            ("manifest.json", json.dumps(body).encode()),
            (f"blobs/{sha(data)}", data),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    out.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    return out


def test_a_path_component_over_255_bytes_is_refused_by_restore_and_server(
    tmp_path: Path, reliability
) -> None:
    archive = _long_name_archive(tmp_path / "long.tar.zst")
    dst = tmp_path / "dst"
    line = _one_line_error(_restore_cli(archive, dst, tmp_path / "home"), "unsafe_path")
    assert "255" in line
    assert visible_files(dst) == {}

    data = b"kernel"
    body = Manifest(files=(FileEntry("ab/short", sha(data), len(data)),), fingerprint=FP).to_dict()
    body["files"][0]["path"] = "ab/" + "é" * 128  # 256 bytes in UTF-8, 128 characters
    with pytest.raises(UnsafePath, match="255"):
        Manifest.from_dict(body)
    server = start_server(Settings(data_dir=tmp_path / "data"))
    try:
        answer = httpx.post(f"{server.url}/v1/snapshots", json=body, timeout=30)
    finally:
        server.stop()
    assert answer.status_code == 422 and answer.json()["error"] == "unsafe_path", answer.text
    reliability.record(
        "manifest path component of 256 bytes: `restore` and the server's publish (422)",
        tries=2,
        outcome="refused",
        area="target dir",
    )


def test_disk_full_during_restore_is_one_line_and_leaves_only_complete_files(
    archive: Path, tmp_path: Path, reliability
) -> None:
    """A real full filesystem: a 512 KiB tmpfs in a private mount namespace (unshare)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    listing = tmp_path / "listing.txt"
    script = (  # mount, restore, then list what is visible with its digest, before exit
        'mnt="$1"; shift; listing="$1"; shift; '
        'mount -t tmpfs -o size=512k tmpfs "$mnt" || exit 99; '
        '"$@"; rc=$?; '
        'cd "$mnt/cache" && find . -path ./.cachekeeper -prune -o -type f '
        '-exec sha256sum {} + > "$listing"; '
        "exit $rc"
    )
    proc = subprocess.run(
        [
            unshare,
            "-rm",
            "sh",
            "-c",
            script,
            "sh",
            str(mnt),
            str(listing),
            *cli("restore", str(archive), "--cache-dir", str(mnt / "cache")),
        ],
        env=child_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode == 99 or "unshare:" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {proc.stderr.strip()}")
    line = _one_line_error(proc, "cache_dir_unusable")
    assert "no space left" in line
    # the 1 MiB file did not fit; whatever is visible is complete and verified
    expected = {rel: sha(data) for rel, data in visible_files(tmp_path / "src").items()}
    visible = dict(reversed(row.split()) for row in listing.read_text().splitlines())
    assert "./cd/big.so" not in visible
    for path, digest in visible.items():
        assert expected[path.removeprefix("./")] == digest, path
    reliability.record(
        "`restore` into a full filesystem (512 KiB tmpfs, 1 MiB file): one-line error, "
        "no partial file",
        tries=1,
        outcome="refused",
        area="disk full",
    )
