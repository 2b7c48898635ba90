"""Signed snapshots: with a trust list, unsigned, wrongly signed and tampered snapshots are
refused by restore, pull and prejob with nothing written; a server that requires
signatures refuses unsigned publishes. Real CLI processes, a real server, real files."""

from __future__ import annotations

import io
import json
import sqlite3
import subprocess
import tarfile
from pathlib import Path

import httpx
import pytest
import zstandard

from cachekeeper.manifest import Manifest
from cachekeeper.signing import generate_keypair, sign_manifest
from tests.hardening.conftest import child_env, cli, visible_files
from tests.helpers.live_server import LiveServer, start_server


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    builder_key, builder_pub, _ = generate_keypair(root / "builder")
    mallory_key, mallory_pub, _ = generate_keypair(root / "mallory")
    return {"key": builder_key, "pub": builder_pub, "mallory": mallory_key}


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("signed") / "cache"
    for i in range(20):
        path = root / f"{i:02d}" / f"k{i}.py"
        path.parent.mkdir(parents=True)
        path.write_bytes(f"# kernel {i}\n".encode() * (50 + 200 * i))
    return root


def _archive_members(archive: Path) -> list[tuple[str, bytes]]:
    raw = zstandard.ZstdDecompressor().stream_reader(archive.open("rb"), read_across_frames=True)
    with tarfile.open(fileobj=io.BytesIO(raw.read()), mode="r:") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]


def _write_archive(out: Path, members: list[tuple[str, bytes]]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return out


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def test_restore_refuses_unsigned_untrusted_and_tampered_archives(
    keys: dict[str, Path], small_cache: Path, tmp_path: Path, reliability
) -> None:
    env = child_env(tmp_path / "home")
    signed = tmp_path / "signed.tar.zst"
    made = _run(
        ["snapshot", str(small_cache), "-o", str(signed), "--sign-key", str(keys["key"]), "--json"],
        env,
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["signed_by"]
    unsigned = tmp_path / "unsigned.tar.zst"
    assert _run(["snapshot", str(small_cache), "-o", str(unsigned)], env).returncode == 0
    mallory = tmp_path / "mallory.tar.zst"
    assert (
        _run(
            ["snapshot", str(small_cache), "-o", str(mallory), "--sign-key", str(keys["mallory"])],
            env,
        ).returncode
        == 0
    )

    members = _archive_members(signed)
    manifest_json = members[0][1]
    body = json.loads(manifest_json)
    body["files"][0]["mode"] = 0o755  # one changed byte in the manifest, still valid JSON
    tampered_manifest = _write_archive(
        tmp_path / "tm.tar.zst", [("manifest.json", json.dumps(body).encode()), *members[1:]]
    )
    last_name, last_blob = members[-1]
    tampered_blob = _write_archive(
        tmp_path / "tb.tar.zst", [*members[:-1], (last_name, _flip(last_blob, len(last_blob) // 2))]
    )
    cases = {
        "unsigned snapshot": (unsigned, "unsigned"),
        "snapshot signed by an untrusted key": (mallory, "not trusted"),
        "one byte changed in the manifest": (tampered_manifest, "does not match"),
        "one byte changed in a blob": (tampered_blob, "corrupt"),
    }
    outside = tmp_path / "outside"
    outside.mkdir()
    for label, (archive, why) in cases.items():
        target = tmp_path / f"dst-{label.replace(' ', '-')}"
        done = _run(
            ["restore", str(archive), "--cache-dir", str(target), "--trust", str(keys["pub"])], env
        )
        assert done.returncode != 0, label
        assert why in done.stderr, (label, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert visible_files(target) == {}, label
        assert list(outside.iterdir()) == []
        reliability.record(
            f"`restore --trust`: {label}", tries=1, outcome="refused", area="signatures"
        )
    # The trust list from the environment works the same; the genuine archive restores.
    env_trust = {**env, "CACHEKEEPER_TRUSTED_KEYS": str(keys["pub"])}
    assert (
        _run(["restore", str(unsigned), "--cache-dir", str(tmp_path / "e")], env_trust).returncode
        != 0
    )
    ok = _run(["restore", str(signed), "--cache-dir", str(tmp_path / "ok")], env_trust)
    assert ok.returncode == 0, ok.stderr
    assert visible_files(tmp_path / "ok") == visible_files(small_cache)


def _stored_manifest(server: LiveServer, snapshot_id: str) -> dict:
    return httpx.get(f"{server.url}/v1/snapshots/{snapshot_id}").json()


def _rewrite_manifest(server: LiveServer, snapshot_id: str, body: dict) -> None:
    db = sqlite3.connect(server.settings.data_dir / "meta.sqlite")
    with db:
        db.execute(
            "UPDATE snapshots SET manifest = ? WHERE id = ?",
            [json.dumps(body, sort_keys=True, separators=(",", ":")), snapshot_id],
        )
    db.close()


def test_pull_and_prejob_refuse_what_is_not_trusted(
    keys: dict[str, Path], small_cache: Path, open_server: LiveServer, tmp_path: Path, reliability
) -> None:
    env = child_env(tmp_path / "home")
    url = open_server.url
    trust = ["--trust", str(keys["pub"])]

    def pull(target: Path) -> subprocess.CompletedProcess[str]:
        return _run(
            ["pull", "--workload", "w", "--server", url, "--cache-dir", str(target), *trust], env
        )

    def prejob(target: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return _run(
            [
                "prejob",
                "--workload",
                "w",
                "--server",
                url,
                "--cache-dir",
                str(target),
                *trust,
                *extra,
            ],
            env,
        )

    def refused(label: str, why: str) -> None:
        target = tmp_path / f"p-{label.replace(' ', '-')}"
        done = pull(target)
        assert done.returncode != 0 and why in done.stderr, (label, done.stderr)
        assert visible_files(target) == {}
        job = prejob(target)
        assert job.returncode == 0, job.stderr
        assert "compile cold" in job.stderr and why in job.stderr, job.stderr
        assert len(job.stderr.strip().splitlines()) == 1
        assert "TORCHINDUCTOR_CACHE_DIR" in job.stdout
        assert prejob(target, "--strict").returncode != 0
        assert visible_files(target) == {}
        reliability.record(
            f"`pull`/`prejob --trust`: {label}", tries=3, outcome="refused", area="signatures"
        )

    # 1. unsigned
    assert (
        _run(
            ["push", str(small_cache), "--workload", "w", "--allow-unregistered", "--server", url],
            env,
        ).returncode
        == 0
    )
    refused("unsigned snapshot", "unsigned")
    # 2. signed by a key not in the trust list (another snapshot, newer: resolve picks it)
    import shutil

    variant = tmp_path / "variant"
    shutil.copytree(small_cache, variant)
    (variant / "zz.py").write_bytes(b"# mallory was here\n")
    assert (
        _run(
            [
                "push",
                str(variant),
                "--workload",
                "w",
                "--allow-unregistered",
                "--server",
                url,
                "--sign-key",
                str(keys["mallory"]),
            ],
            env,
        ).returncode
        == 0
    )
    refused("snapshot signed by an untrusted key", "not trusted")
    # 3. properly signed (the newest again); then tamper with it on the server.
    genuine = tmp_path / "genuine"
    shutil.copytree(small_cache, genuine)
    (genuine / "zz.py").write_bytes(b"# the builder's own\n")
    pushed = _run(
        [
            "push",
            str(genuine),
            "--workload",
            "w",
            "--allow-unregistered",
            "--server",
            url,
            "--sign-key",
            str(keys["key"]),
            "--json",
        ],
        env,
    )
    assert pushed.returncode == 0, pushed.stderr
    snapshot_id = json.loads(pushed.stdout)["snapshot_id"]
    good = tmp_path / "good"
    assert pull(good).returncode == 0
    assert visible_files(good) == visible_files(genuine)
    assert prejob(good).returncode == 0  # already restored by a trusted restore

    body = _stored_manifest(open_server, snapshot_id)
    signature = dict(body["signature"])
    body["signature"]["signature"] = signature["signature"][:-4] + (
        "AAAA" if not signature["signature"].endswith("AAAA") else "BBBB"
    )
    _rewrite_manifest(open_server, snapshot_id, body)
    refused("signature bytes changed on the server", "does not match")

    body["signature"] = signature
    body["files"][0]["size_bytes"] += 1  # one byte of the manifest: its id no longer matches
    _rewrite_manifest(open_server, snapshot_id, body)
    refused("one byte changed in the manifest on the server", "id")
    body["files"][0]["size_bytes"] -= 1
    _rewrite_manifest(open_server, snapshot_id, body)

    # One byte changed in a stored blob: the archive carries it, restore verifies it.
    digest = body["files"][-1]["digest"]
    blob_path = next((open_server.settings.data_dir / "blobs").glob(f"??/??/{digest}.zst"))
    original = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob_path.read_bytes())).read()
    blob_path.write_bytes(zstandard.ZstdCompressor().compress(_flip(original, 3)))
    refused("one byte changed in a blob on the server", "corrupt")


def test_server_requiring_signatures_refuses_unsigned_publishes(
    keys: dict[str, Path], small_cache: Path, tmp_path: Path, reliability
) -> None:
    from cachekeeper.server.settings import Settings
    from cachekeeper.snapshot import snapshot_dir
    from cachekeeper.store import LocalStore

    with pytest.raises(ValueError, match="trusted_keys"):
        Settings(data_dir=tmp_path / "x", require_signatures=True)
    handle = start_server(
        Settings(data_dir=tmp_path / "data", require_signatures=True, trusted_keys=[keys["pub"]])
    )
    try:
        store = LocalStore(home=tmp_path / "home")
        manifest = snapshot_dir(small_cache, store=store, workload="w")
        with httpx.Client(base_url=handle.url, timeout=30) as c:
            for digest in manifest.digests:
                assert c.put(
                    f"/v1/blobs/{digest}", content=store.blobs.read(digest)
                ).status_code in (200, 201)
            attempts = {
                "unsigned manifest": manifest,
                "manifest signed by an untrusted key": sign_manifest(manifest, keys["mallory"]),
            }
            tampered = sign_manifest(manifest, keys["key"]).to_dict()
            tampered["workload"] = "x"  # changed after signing
            for label, candidate in attempts.items():
                answer = c.post("/v1/snapshots", content=candidate.to_json())
                assert (
                    answer.status_code == 422 and answer.json()["error"] == "signature_invalid"
                ), answer.text
                reliability.record(
                    f"publish to a server requiring signatures: {label}",
                    tries=1,
                    outcome="refused",
                    area="signatures",
                )
            answer = c.post("/v1/snapshots", content=json.dumps(tampered))
            assert answer.status_code == 422 and answer.json()["error"] == "signature_invalid"
            reliability.record(
                "publish to a server requiring signatures: manifest changed after signing",
                tries=1,
                outcome="refused",
                area="signatures",
            )
            assert c.get("/v1/snapshots").json()["snapshots"] == []
            signed = sign_manifest(manifest, keys["key"])
            assert c.post("/v1/snapshots", content=signed.to_json()).status_code == 201
            assert Manifest.from_json(c.get(f"/v1/snapshots/{signed.id}").content).signature
    finally:
        handle.stop()
