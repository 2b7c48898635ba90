"""The server killed mid-upload, mid-publish and mid-download; a disk that fills up.

The server runs as a real ``cachekeeper serve`` child process, SIGKILLed and restarted on
the same data dir. The full disk is an injection (see that test's docstring).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import cachekeeper.backends.local as blobstore_module
from cachekeeper.errors import InsufficientStorage
from tests.hardening.conftest import ServerProcess, child_env, cli, visible_files
from tests.helpers.live_server import start_server


def _blob_files(data_dir: Path) -> set[str]:
    return {p.name[: -len(".zst")] for p in (data_dir / "blobs").glob("??/??/*.zst")}


def _tmp_files(data_dir: Path) -> list[Path]:
    tmp = data_dir / "blobs" / ".tmp"
    return list(tmp.iterdir()) if tmp.is_dir() else []


def _assert_every_snapshot_has_its_blobs(url: str) -> int:
    with httpx.Client(base_url=url, timeout=30) as c:
        snapshots = c.get("/v1/snapshots").json()["snapshots"]
        for summary in snapshots:
            manifest = c.get(f"/v1/snapshots/{summary['id']}").json()
            digests = sorted({f["digest"] for f in manifest["files"]})
            missing = c.post("/v1/blobs/missing", json={"digests": digests}).json()["missing"]
            assert missing == [], f"snapshot {summary['id'][:12]} is published without its blobs"
    return len(snapshots)


def test_server_killed_mid_upload_keeps_no_half_blob(
    server_process: ServerProcess, reliability
) -> None:
    rng = random.Random(5)
    data = rng.randbytes(8 << 20)
    digest = hashlib.sha256(data).hexdigest()
    data_dir = server_process.data_dir
    kills = 0
    for cut in (1 << 20, 3 << 20, 6 << 20):
        server_process.start()
        sock = socket.create_connection(("127.0.0.1", server_process.port))
        sock.sendall(
            f"PUT /v1/blobs/{digest} HTTP/1.1\r\nHost: x\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data[:cut]
        )
        deadline = time.monotonic() + 10
        while not _tmp_files(data_dir) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _tmp_files(data_dir), "the upload never reached the blob store"
        server_process.kill()  # mid-upload: a temp file is on disk
        kills += 1
        sock.close()
        assert digest not in _blob_files(data_dir)
        server_process.start()  # restarted on the same data dir
        assert _tmp_files(data_dir) == []
        with httpx.Client(base_url=server_process.url, timeout=30) as c:
            assert c.post("/v1/blobs/missing", json={"digests": [digest]}).json()["missing"] == [
                digest
            ]
            assert c.get(f"/v1/blobs/{digest}").status_code == 404
        server_process.kill()
    server_process.start()
    with httpx.Client(base_url=server_process.url, timeout=60) as c:
        assert c.put(f"/v1/blobs/{digest}", content=data).status_code == 201
        assert c.get(f"/v1/blobs/{digest}").content == data
    reliability.record(
        "server SIGKILLed mid-upload of an 8 MB blob, restarted on the same data dir",
        tries=kills,
        outcome="kept",
        area="server killed",
    )
    reliability.record(
        "upload retried after the server's restart",
        tries=1,
        outcome="recovered",
        area="server killed",
    )


def _push_command(cache: Path, url: str) -> list[str]:
    """``cachekeeper push`` of ``cache`` as workload ``w`` (unregistered) to ``url``."""
    return cli("push", str(cache), "--workload", "w", "--allow-unregistered", "--server", url)


def test_server_killed_during_push_never_publishes_without_blobs(
    server_process: ServerProcess, cache_tree: Path, tmp_path: Path, reliability
) -> None:
    rng = random.Random(11)
    env = child_env(tmp_path / "client-home")
    server_process.start()
    started = time.monotonic()
    push = _push_command(cache_tree, server_process.url)
    subprocess.run(push, env=env, check=True, capture_output=True, timeout=180)
    full_s = time.monotonic() - started
    server_process.kill()
    # A fresh data dir per try, so each push uploads everything again. Each kill lands
    # after the first blob is stored (the push is under way), at a random point after it.
    kills = mid_push = 0
    for i in range(2):
        proc = ServerProcess(data_dir=tmp_path / f"data{i}", home=tmp_path / "srv-home")
        proc.start()
        try:
            pusher = subprocess.Popen(
                _push_command(cache_tree, proc.url),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 120
            while not _blob_files(proc.data_dir):
                assert pusher.poll() is None, "the push ended before it stored a blob"
                assert time.monotonic() < deadline, "the push never stored a blob"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.25 * full_s))
            proc.kill()
            kills += 1
            mid_push += pusher.wait(120) != 0  # the push failed: the kill landed during it
            proc.start()
            _assert_every_snapshot_has_its_blobs(proc.url)
            assert _tmp_files(proc.data_dir) == []
            rerun = subprocess.run(
                _push_command(cache_tree, proc.url),
                env=env,
                capture_output=True,
                timeout=180,
            )
            assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
            assert _assert_every_snapshot_has_its_blobs(proc.url) == 1
        finally:
            proc.kill()
    assert mid_push >= 1, "every push finished before its kill: nothing was tested"
    reliability.record(
        f"server SIGKILLed while `cachekeeper push` uploads and publishes ({mid_push} kills"
        " mid-push)",
        tries=kills,
        outcome="kept",
        area="server killed",
    )
    reliability.record(
        "`cachekeeper push` rerun after the server's restart",
        tries=kills,
        outcome="recovered",
        area="server killed",
    )


def test_server_killed_mid_download_leaves_only_complete_files(
    server_process: ServerProcess, cache_tree: Path, tmp_path: Path, reliability
) -> None:
    rng = random.Random(3)
    env = child_env(tmp_path / "client-home")
    server_process.start()
    push = _push_command(cache_tree, server_process.url)
    subprocess.run(push, env=env, check=True, capture_output=True, timeout=180)
    expected = visible_files(cache_tree)

    def pull(target: Path) -> list[str]:
        return cli(
            "pull", "--workload", "w", "--server", server_process.url, "--cache-dir", str(target)
        )

    started = time.monotonic()
    subprocess.run(pull(tmp_path / "timing"), env=env, check=True, capture_output=True)
    full_s = time.monotonic() - started
    kills = mid_download = 0
    for i in range(3):
        target = tmp_path / f"t{i}"
        puller = subprocess.Popen(
            pull(target), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        # once the first verified file is staged (the archive is streaming), at random
        staging = target / ".cachekeeper" / "staging"
        deadline = time.monotonic() + 120
        while not (staging.is_dir() and any(p.is_file() for p in staging.rglob("*"))):
            assert puller.poll() is None, "the pull ended before it staged a file"
            assert time.monotonic() < deadline, "the pull never staged a file"
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.2 * full_s))
        server_process.kill()
        kills += 1
        mid_download += puller.wait(120) != 0  # the pull failed: the kill cut its stream
        for rel, content in visible_files(target).items():
            assert rel in expected, rel
            if "__grp__" not in rel:  # group files are rewritten to the new root
                assert content == expected[rel], f"{rel} is partial"
        server_process.start()
        rerun = subprocess.run(pull(target), env=env, capture_output=True, timeout=120)
        assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
        assert set(visible_files(target)) == set(expected)
    assert mid_download >= 1, "every pull finished before its kill: nothing was tested"
    reliability.record(
        f"server SIGKILLed while `cachekeeper pull` streams the archive ({mid_download} kills"
        " mid-download)",
        tries=kills,
        outcome="kept",
        area="server killed",
    )
    reliability.record(
        "`cachekeeper pull` rerun after the server's restart",
        tries=kills,
        outcome="recovered",
        area="server killed",
    )


class _FillingFile:
    """A file object whose writes fail with ENOSPC once ``budget`` bytes went through."""

    def __init__(self, fh: Any, budget: int) -> None:
        self._fh = fh
        self._left = budget

    def write(self, data: Any) -> int:
        if len(data) > self._left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= len(data)
        return int(self._fh.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)

    def __enter__(self) -> _FillingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()


def test_disk_full_during_upload_answers_507_and_keeps_no_half_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reliability
) -> None:
    """The full disk is injected: ``open`` inside ``cachekeeper.backends.local`` hands the blob
    store a file whose writes raise ENOSPC after 1 MiB. A loop-mounted or size-limited
    filesystem would need root (mount) privileges, which the test machine does not
    assume; the injection sits exactly where a real full disk fails (the temp file's
    write), and the rest runs for real: a live uvicorn server, HTTP, the blob store."""
    from cachekeeper.client.api import CacheClient
    from cachekeeper.client.push import push
    from cachekeeper.server.settings import Settings
    from cachekeeper.store import LocalStore

    real_open = open

    def filling_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(path, mode, *args, **kwargs)
        if "w" in mode and ".tmp" in Path(path).parts:
            return _FillingFile(fh, budget=1 << 20)
        return fh

    data = random.Random(9).randbytes(6 << 20)
    digest = hashlib.sha256(data).hexdigest()
    handle = start_server(Settings(data_dir=tmp_path / "data"))
    try:
        monkeypatch.setattr(blobstore_module, "open", filling_open, raising=False)
        with httpx.Client(base_url=handle.url, timeout=60) as c:
            answer = c.put(f"/v1/blobs/{digest}", content=data)
            assert answer.status_code == 507, answer.text
            assert answer.json()["error"] == "insufficient_storage"
            assert digest not in _blob_files(handle.settings.data_dir)
            assert _tmp_files(handle.settings.data_dir) == []
            assert c.post("/v1/blobs/missing", json={"digests": [digest]}).json()["missing"]
        # The same through the client's push: one clear error, nothing published.
        src = tmp_path / "cache"
        (src / "ab").mkdir(parents=True)
        (src / "ab" / "big.so").write_bytes(data)
        with CacheClient(base_url=handle.url) as client:
            with pytest.raises(InsufficientStorage):
                push(src, client=client, workload="w", store=LocalStore(home=tmp_path / "h"))
        with httpx.Client(base_url=handle.url, timeout=60) as c:
            assert c.get("/v1/snapshots").json()["snapshots"] == []
        assert _tmp_files(handle.settings.data_dir) == []
        monkeypatch.undo()  # space freed: the same upload now succeeds
        with httpx.Client(base_url=handle.url, timeout=60) as c:
            assert c.put(f"/v1/blobs/{digest}", content=data).status_code == 201
            assert c.get(f"/v1/blobs/{digest}").content == data
    finally:
        handle.stop()
    reliability.record(
        "disk full (ENOSPC injected) during a blob upload: 507 insufficient_storage",
        tries=2,
        outcome="refused",
        area="disk full",
    )
    reliability.record(
        "upload retried once space is back", tries=1, outcome="recovered", area="disk full"
    )
