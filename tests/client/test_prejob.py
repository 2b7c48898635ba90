"""The pre-job hook against servers that misbehave: down, slow, 500, garbage, cut off.

A real server cannot be made to misbehave on cue, so these tests run a tiny real HTTP
server on 127.0.0.1 (``http.server``) that speaks just enough of docs/api.md: resolve,
the manifest, and the archive stream, each of which a test can make fail. The hook runs
as a real process (``cachekeeper prejob``) wherever its exit status or timing is the claim.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import zstandard
from cachekeeper.client.api import CacheClient
from cachekeeper.client.prejob import prejob
from cachekeeper.client.pull import pull

from cachekeeper.errors import CacheDirUnusable
from cachekeeper.manifest import Manifest
from cachekeeper.restore import is_restored
from cachekeeper.snapshot import snapshot_dir
from cachekeeper.store import LocalStore
from tests.helpers.bodies import summary_body
from tests.helpers.caches import make_cache
from tests.helpers.ports import free_port

CLI = [str(Path(sys.executable).parent / "cachekeeper")]


def archive_bytes(manifest: Manifest, store: LocalStore, digests: set[str]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        body = manifest.to_json().encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
        for digest in sorted(digests):
            data = store.blobs.read(digest)
            info = tarfile.TarInfo(f"blobs/{digest}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return zstandard.ZstdCompressor(level=1).compress(raw.getvalue())


class TinyServer:
    """Serves one snapshot; ``behaviour(route, handler) -> bool`` may answer instead."""

    def __init__(self, manifest: Manifest, store: LocalStore) -> None:
        self.manifest = manifest
        self.store = store
        self.requests: list[str] = []
        self.behaviour: Callable[[str, BaseHTTPRequestHandler], bool] = lambda r, h: False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, body: bytes, ctype: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def _route(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                payload = json.loads(self.rfile.read(length)) if length else None
                route = f"{method} {self.path}"
                outer.requests.append(route)
                if outer.behaviour(route, self):
                    return
                snap = outer.manifest.id
                if route == "POST /v1/resolve":
                    summary = summary_body(snap)
                    body = {"snapshot": summary, "verified": True, "exact": True, "near_misses": []}
                    self._answer(200, json.dumps(body).encode())
                elif route == f"GET /v1/snapshots/{snap}":
                    self._answer(200, outer.manifest.to_json().encode())
                elif route == f"POST /v1/snapshots/{snap}/archive":
                    data = archive_bytes(outer.manifest, outer.store, set(payload["digests"]))
                    self._answer(200, data, "application/zstd")
                else:
                    self._answer(404, b'{"error": "snapshot_not_found", "detail": "no"}')

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def snapshot(tmp_path: Path) -> tuple[Manifest, LocalStore]:
    src = tmp_path / "src"
    make_cache(src)
    store = LocalStore(home=tmp_path / "store")
    return snapshot_dir(src, store=store, workload="w"), store


@pytest.fixture
def tiny(snapshot):
    server = TinyServer(*snapshot)
    yield server
    server.close()


def run_prejob(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    """The hook's run; ``timeout`` is a hang guard (the test fails if it hangs), not a speed claim."""
    return subprocess.run(
        [*CLI, "prejob", "--workload", "w", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def files_match(manifest: Manifest, cache_dir: Path, store: LocalStore) -> list[str]:
    """Paths present in cache_dir; asserts each present one is complete and correct."""
    present = []
    for entry in manifest.files:
        path = cache_dir / entry.path
        if path.exists():
            assert path.read_bytes() == store.blobs.read(entry.digest), entry.path
            present.append(entry.path)
    return present


def visible_files(cache_dir: Path) -> set[str]:
    return {
        str(p.relative_to(cache_dir))
        for p in cache_dir.rglob("*")
        if p.is_file() and ".cachekeeper" not in p.parts
    }


def test_restores_into_empty_dir_then_noop(tiny, snapshot, tmp_path):
    manifest, store = snapshot
    cache = tmp_path / "cache"
    proc = run_prejob("--server", tiny.url, "--cache-dir", str(cache))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={cache}\n"
    assert is_restored(manifest.id, cache)
    assert len(files_match(manifest, cache, store)) == len(manifest.files)
    archives = [r for r in tiny.requests if r.endswith("/archive")]
    assert len(archives) == 1
    assert tiny.requests.count("POST /v1/resolve") == 1  # the no-op check's answer is reused

    proc = run_prejob("--server", tiny.url, "--cache-dir", str(cache), "--json")
    report = json.loads(proc.stdout)
    assert report["outcome"] == "already_restored"
    assert len([r for r in tiny.requests if r.endswith("/archive")]) == 1
    assert tiny.requests.count("POST /v1/resolve") == 2


NOOP_MODULES = """
import sys
from cachekeeper.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = ("httpx", "zstandard", "cachekeeper.restore", "cachekeeper.client.api",
         "cachekeeper.client.pull", "cachekeeper.wire.fleet", "cachekeeper.wire.snapshots")
print("LOADED=" + ",".join(m for m in heavy if m in sys.modules), file=sys.stderr)
"""


def test_the_no_op_path_loads_neither_the_http_client_nor_the_restore_stack(
    tiny, snapshot, tmp_path
):
    """The hook's start-up budget: what every job start pays must stay small."""
    manifest, _ = snapshot
    cache = tmp_path / "cache"
    assert run_prejob("--server", tiny.url, "--cache-dir", str(cache)).returncode == 0
    args = ["prejob", "--workload", "w", "--server", tiny.url, "--cache-dir", str(cache)]
    proc = subprocess.run(
        [sys.executable, "-c", NOOP_MODULES, *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "LOADED=", proc.stderr
    assert is_restored(manifest.id, cache)


def test_server_down_exits_zero_fast_with_one_line(tmp_path):
    cache = tmp_path / "cache"
    env_file = tmp_path / "env" / "prejob.env"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = run_prejob(
        "--server", url, "--cache-dir", str(cache), "--timeout", "5", "--env-file", str(env_file),
        timeout=50,  # hang guard (10x the hook's timeout), not a speed claim
    )  # fmt: skip
    assert proc.returncode == 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("cachekeeper: no cache restored (server unreachable")
    assert lines[0].endswith("this job will compile cold")
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={cache}\n"
    assert env_file.read_text() == proc.stdout
    # Fast = it gave up on the refusal itself, not by waiting out the 5 s timeout.
    assert "Connection refused" in lines[0] and "gave up" not in lines[0]

    proc = run_prejob("--server", url, "--cache-dir", str(cache), "--timeout", "5", "--strict")
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "no cache restored" in proc.stderr


def test_no_server_configured_is_a_cold_start_not_a_failure(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CACHEKEEPER_SERVER"}
    proc = subprocess.run(
        [*CLI, "prejob", "--workload", "w", "--cache-dir", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0
    assert proc.stderr.startswith("cachekeeper: no cache restored (no server configured")


def answer_500(route: str, handler) -> bool:
    handler._answer(500, b"Internal Server Error", "text/plain")
    return True


def answer_garbage(route: str, handler) -> bool:
    handler._answer(200, b"\x00\xffnot json at all")
    return True


@pytest.mark.parametrize(
    ("behaviour", "why"),
    [(answer_500, "HTTP 500"), (answer_garbage, "not JSON")],
    ids=["500", "garbage"],
)
def test_erroring_server_gives_a_cold_start(tiny, tmp_path, behaviour, why):
    tiny.behaviour = behaviour
    proc = run_prejob("--server", tiny.url, "--cache-dir", str(tmp_path / "c"))
    assert proc.returncode == 0
    assert proc.stderr.count("\n") == 1
    assert why in proc.stderr and "no cache restored" in proc.stderr
    assert "export TORCHINDUCTOR_CACHE_DIR=" in proc.stdout
    if behaviour is answer_500:
        assert tiny.requests.count("POST /v1/resolve") > 1  # 5xx is retried


def test_slow_server_is_abandoned_at_the_timeout(tiny, tmp_path):
    def stall(route: str, handler) -> bool:
        time.sleep(30)
        return False

    tiny.behaviour = stall
    proc = run_prejob(
        "--server", tiny.url, "--cache-dir", str(tmp_path / "c"), "--timeout", "2",
        timeout=20,  # hang guard (10x the hook's timeout; the server stalls 30 s), not a speed claim
    )  # fmt: skip
    assert proc.returncode == 0
    assert "no cache restored" in proc.stderr, proc.stderr
    assert "ReadTimeout: timed out" in proc.stderr  # abandoned at the timeout, not the stall


def test_download_cut_off_leaves_no_partial_file_and_rerun_completes(tiny, snapshot, tmp_path):
    manifest, store = snapshot
    cache = tmp_path / "cache"
    (cache / "mine").mkdir(parents=True)
    (cache / "mine" / "keep.txt").write_text("not from the snapshot")

    def cut_off(route: str, handler) -> bool:
        if not route.endswith("/archive"):
            return False
        data = archive_bytes(manifest, store, set(json_digests(manifest)))
        handler.send_response(200)
        handler.send_header("Content-Type", "application/zstd")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data[: len(data) // 2])
        handler.wfile.flush()
        handler.connection.shutdown(socket.SHUT_RDWR)
        handler.close_connection = True
        return True

    tiny.behaviour = cut_off
    report = prejob(workload="w", server=tiny.url, cache_dir=cache, timeout_s=20)
    assert report.cold and "cut off" in (report.reason or ""), report
    assert sum(r.endswith("/archive") for r in tiny.requests) == 3  # retried, then gave up
    present = files_match(manifest, cache, store)  # whatever is there is complete
    assert len(present) < len(manifest.files)
    assert visible_files(cache) == set(present) | {"mine/keep.txt"}
    assert not is_restored(manifest.id, cache)

    tiny.behaviour = lambda r, h: False
    report = prejob(workload="w", server=tiny.url, cache_dir=cache, timeout_s=20)
    assert report.outcome == "restored", report
    assert is_restored(manifest.id, cache)
    assert len(files_match(manifest, cache, store)) == len(manifest.files)
    assert (cache / "mine" / "keep.txt").read_text() == "not from the snapshot"


def json_digests(manifest: Manifest) -> list[str]:
    return sorted(manifest.digests)


def test_default_cache_dir_is_per_fingerprint_under_home(tiny, tmp_path):
    from cachekeeper.fingerprint import collect, digest_of

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["CACHEKEEPER_HOME"] = str(tmp_path / "home dir")
    proc = subprocess.run(
        [*CLI, "prejob", "--workload", "w", "--server", tiny.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    expected = tmp_path / "home dir" / "inductor" / digest_of(collect(environ=env))[:16]
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR='{expected}'\n"
    # eval-able: a shell sees the exact path despite the space
    shell = subprocess.run(
        [
            "bash",
            "-c",
            f'eval "$({CLI[0]} prejob --workload w '
            f'--server {tiny.url})"; printf %s "$TORCHINDUCTOR_CACHE_DIR"',
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert shell.stdout == str(expected)

    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "explicit")
    proc = subprocess.run(
        [*CLI, "prejob", "--workload", "w", "--server", tiny.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={tmp_path / 'explicit'}\n"


def test_a_lock_held_by_a_stuck_process_does_not_hold_the_job(tiny, snapshot, tmp_path):
    import fcntl

    cache = tmp_path / "cache"
    (cache / ".cachekeeper").mkdir(parents=True)
    with open(cache / ".cachekeeper" / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a rank that hangs while holding the node's lock
        proc = run_prejob("--server", tiny.url, "--cache-dir", str(cache), "--timeout", "2",
                          timeout=20)  # fmt: skip  # hang guard (10x the hook's timeout)
    assert proc.returncode == 0
    assert "gave up waiting after the 2 s timeout" in proc.stderr
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={cache}\n"


def test_a_cache_dir_that_cannot_be_created_gives_a_cold_start(tiny, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    cache = tmp_path / "a-file" / "cache"
    report = prejob(workload="w", server=tiny.url, cache_dir=cache, timeout_s=10)
    assert report.cold
    assert (report.reason or "").startswith(f"cache_dir_unusable: cannot use {cache} as")
    assert report.exports == {}  # never export a dir the job cannot use


def test_state_folder_as_a_file_fails_pull_cleanly_and_prejob_cold(tiny, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".cachekeeper").write_bytes(b"someone's file")
    with (
        CacheClient(base_url=tiny.url) as client,
        pytest.raises(CacheDirUnusable, match="not a folder"),
    ):
        pull(client=client, workload="w", cache_dir=cache, fingerprint={"schema": 1})
    report = prejob(workload="w", server=tiny.url, cache_dir=cache, timeout_s=10)
    assert report.cold and (report.reason or "").startswith("cache_dir_unusable: "), report
    assert (cache / ".cachekeeper").read_bytes() == b"someone's file"
    assert visible_files(cache) == set()


def test_a_hung_server_over_a_restored_dir_says_the_job_uses_what_it_holds(tiny, tmp_path):
    """Issue 25: with the server hung and the dir already restored, the hook said "this job
    will compile cold", though the job hits what an earlier restore left."""
    cache = tmp_path / "cache"
    assert run_prejob("--server", tiny.url, "--cache-dir", str(cache)).returncode == 0

    def stall(route: str, handler) -> bool:
        time.sleep(30)
        return False

    tiny.behaviour = stall
    proc = run_prejob(
        "--server", tiny.url, "--cache-dir", str(cache), "--timeout", "2", "--json",
        timeout=20,  # hang guard (10x the hook's timeout; the server stalls 30 s), not a speed claim
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "will compile cold" not in line, line
    held = tiny.manifest.id
    assert f"the cache dir still holds snapshot {held[:12]} from an earlier restore" in line
    report = json.loads(proc.stdout)
    assert report["outcome"] == "cold" and report["held_snapshot_id"] == held
    # an empty dir under the same hung server is a cold start, said as one
    empty = run_prejob("--server", tiny.url, "--cache-dir", str(tmp_path / "e"), "--timeout", "2",
                       timeout=20)  # fmt: skip
    assert "this job will compile cold" in empty.stderr, empty.stderr
