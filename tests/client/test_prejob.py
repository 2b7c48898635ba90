"""The pre-job hook against the real server, and against that server when it misbehaves:
down, slow, 500, garbage, cut off mid-archive.

The snapshot is a real push (``client.push``) to a real server (uvicorn on loopback,
tests/helpers/live_server.py), and every archive the hook restores is the one that
server streams. The faults sit in front of it: a TCP relay (``slow_servers.forward``)
passes every request through unchanged, and a test breaks one route on cue (a stall, a
500, garbage, a connection cut a megabyte into the archive) while the real server answers
the rest. The relay also counts what the hook asked. The hook runs as a real process
(``cachekeeper prejob``) wherever its exit status or timing is the claim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.prejob import prejob
from cachekeeper.client.pull import pull
from cachekeeper.client.push import push
from cachekeeper.errors import CacheDirUnusable
from cachekeeper.manifest import Manifest
from cachekeeper.restore import is_restored
from cachekeeper.server.settings import Settings
from cachekeeper.store import LocalStore
from tests.helpers.caches import make_cache
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.ports import free_port
from tests.helpers.slow_servers import FakeServer, answer, forward, stall

CLI = [str(Path(sys.executable).parent / "cachekeeper")]


@dataclass(frozen=True)
class Served:
    """One snapshot of ``src`` (workload ``w``) pushed to ``live``."""

    live: LiveServer
    src: Path
    manifest: Manifest


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("prejob")
    src = root / "src"
    make_cache(src)
    with start_server(Settings(data_dir=root / "data")) as live:
        with CacheClient(base_url=live.url) as client:
            pushed = push(src, client=client, workload="w", store=LocalStore(home=root / "store"))
            manifest = client.get_manifest(pushed.snapshot_id)
        yield Served(live=live, src=src, manifest=manifest)


@pytest.fixture
def relay(served: Served) -> Iterator[FakeServer]:
    """The real server behind a relay whose routes a test may break."""
    proxy = FakeServer({"/": forward(served.live.url)})
    yield proxy
    proxy.close()


def asked(proxy: FakeServer) -> list[str]:
    """What the hook asked the relay, in order: ``METHOD /path``."""
    return [f"{r.method} {r.path}" for r in proxy.requests]


def run_prejob(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    """The hook's run; ``timeout`` is a hang guard (the test fails if it hangs), not a speed claim."""
    return subprocess.run(
        [*CLI, "prejob", "--workload", "w", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def files_match(served: Served, cache_dir: Path) -> list[str]:
    """Paths present in cache_dir; asserts each present one is the pushed file's bytes."""
    present = []
    for entry in served.manifest.files:
        path = cache_dir / entry.path
        if path.exists():
            assert path.read_bytes() == (served.src / entry.path).read_bytes(), entry.path
            present.append(entry.path)
    return present


def visible_files(cache_dir: Path) -> set[str]:
    return {
        str(p.relative_to(cache_dir))
        for p in cache_dir.rglob("*")
        if p.is_file() and ".cachekeeper" not in p.parts
    }


def test_restores_into_empty_dir_then_noop(served, relay, tmp_path):
    manifest = served.manifest
    cache = tmp_path / "cache"
    proc = run_prejob("--server", relay.url, "--cache-dir", str(cache))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={cache}\n"
    assert is_restored(manifest.id, cache)
    assert len(files_match(served, cache)) == len(manifest.files) == 4
    archives = [r for r in asked(relay) if r.endswith("/archive")]
    assert len(archives) == 1
    assert asked(relay).count("POST /v1/resolve") == 1  # the no-op check's answer is reused

    proc = run_prejob("--server", relay.url, "--cache-dir", str(cache), "--json")
    report = json.loads(proc.stdout)
    assert report["outcome"] == "already_restored"
    assert len([r for r in asked(relay) if r.endswith("/archive")]) == 1
    assert asked(relay).count("POST /v1/resolve") == 2


NOOP_MODULES = """
import sys
from cachekeeper.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = ("httpx", "zstandard", "cachekeeper.restore.core", "cachekeeper.restore.sources",
         "cachekeeper.restore.writer", "cachekeeper.client.api",
         "cachekeeper.client.pull", "cachekeeper.wire.fleet", "cachekeeper.wire.snapshots")
print("LOADED=" + ",".join(m for m in heavy if m in sys.modules), file=sys.stderr)
"""


def test_the_no_op_path_loads_neither_the_http_client_nor_the_restore_stack(served, tmp_path):
    """The hook's start-up budget: what every job start pays must stay small."""
    url, cache = served.live.url, tmp_path / "cache"
    assert run_prejob("--server", url, "--cache-dir", str(cache)).returncode == 0
    assert is_restored(served.manifest.id, cache)
    args = ["prejob", "--workload", "w", "--server", url, "--cache-dir", str(cache), "--json"]
    proc = subprocess.run(
        [sys.executable, "-c", NOOP_MODULES, *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["outcome"] == "already_restored"  # the no-op path it was
    assert proc.stderr.strip().splitlines()[-1] == "LOADED=", proc.stderr


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


@pytest.mark.parametrize(
    ("route", "why"),
    [
        (answer(b"Internal Server Error", status=500, content_type="text/plain"), "HTTP 500"),
        (answer(b"\x00\xffnot json at all"), "not JSON"),
    ],
    ids=["500", "garbage"],
)
def test_erroring_server_gives_a_cold_start(relay, tmp_path, route, why):
    relay.routes["/"] = route  # every route, in place of the real server's answers
    cache = tmp_path / "c"
    proc = run_prejob("--server", relay.url, "--cache-dir", str(cache))
    assert proc.returncode == 0
    assert proc.stderr.count("\n") == 1
    assert why in proc.stderr and "no cache restored" in proc.stderr
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={cache}\n"
    if why == "HTTP 500":
        assert asked(relay).count("POST /v1/resolve") > 1  # 5xx is retried


@pytest.mark.slow  # waits out the hook's 2 s timeout
def test_slow_server_is_abandoned_at_the_timeout(relay, tmp_path):
    relay.routes["/"] = stall()  # reads each request, never answers (until the test ends)
    proc = run_prejob(
        "--server", relay.url, "--cache-dir", str(tmp_path / "c"), "--timeout", "2",
        timeout=20,  # hang guard (10x the hook's timeout; the server never answers)
    )  # fmt: skip
    assert proc.returncode == 0
    assert "no cache restored" in proc.stderr, proc.stderr
    assert "ReadTimeout: timed out" in proc.stderr  # abandoned at the timeout
    assert asked(relay)[0] == "POST /v1/resolve"  # it reached the server, which stalled


def test_download_cut_off_leaves_no_partial_file_and_rerun_completes(served, relay, tmp_path):
    manifest = served.manifest
    cache = tmp_path / "cache"
    (cache / "mine").mkdir(parents=True)
    (cache / "mine" / "keep.txt").write_text("not from the snapshot")
    archive = f"/v1/snapshots/{manifest.id}/archive"
    # the real archive, cut 1 MiB in: inside the 3 MiB kernel.so, past the small files
    relay.routes[archive] = forward(served.live.url, cut_after_bytes=1 << 20)
    report = prejob(workload="w", server=relay.url, cache_dir=cache, timeout_s=20)
    assert report.cold and "cut off" in (report.reason or ""), report
    assert sum(r.endswith("/archive") for r in asked(relay)) == 3  # retried, then gave up
    present = files_match(served, cache)  # whatever is there is complete
    assert "cd/kernel.so" not in present and len(present) < len(manifest.files)
    assert visible_files(cache) == set(present) | {"mine/keep.txt"}
    assert not is_restored(manifest.id, cache)

    del relay.routes[archive]  # the network is back
    report = prejob(workload="w", server=relay.url, cache_dir=cache, timeout_s=20)
    assert report.outcome == "restored", report
    assert is_restored(manifest.id, cache)
    assert len(files_match(served, cache)) == len(manifest.files)
    assert (cache / "mine" / "keep.txt").read_text() == "not from the snapshot"


def test_default_cache_dir_is_per_fingerprint_under_home(served, tmp_path):
    from cachekeeper.fingerprint import collect, digest_of

    url = served.live.url
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["CACHEKEEPER_HOME"] = str(tmp_path / "home dir")
    proc = subprocess.run(
        [*CLI, "prejob", "--workload", "w", "--server", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    expected = tmp_path / "home dir" / "inductor" / digest_of(collect(environ=env))[:16]
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR='{expected}'\n"
    assert is_restored(served.manifest.id, expected)  # and the snapshot went there
    # eval-able: a shell sees the exact path despite the space
    shell = subprocess.run(
        [
            "bash",
            "-c",
            f'eval "$({CLI[0]} prejob --workload w '
            f'--server {url})"; printf %s "$TORCHINDUCTOR_CACHE_DIR"',
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert shell.stdout == str(expected)

    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "explicit")
    proc = subprocess.run(
        [*CLI, "prejob", "--workload", "w", "--server", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={tmp_path / 'explicit'}\n"


@pytest.mark.slow  # waits out the hook's 2 s timeout
def test_a_lock_held_by_a_stuck_process_does_not_hold_the_job(served, tmp_path):
    import fcntl

    cache = tmp_path / "cache"
    (cache / ".cachekeeper").mkdir(parents=True)
    with open(cache / ".cachekeeper" / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a rank that hangs while holding the node's lock
        proc = run_prejob("--server", served.live.url, "--cache-dir", str(cache), "--timeout",
                          "2", timeout=20)  # fmt: skip  # hang guard (10x the hook's timeout)
    assert proc.returncode == 0
    assert "gave up waiting after the 2 s timeout" in proc.stderr
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={cache}\n"


def test_a_cache_dir_that_cannot_be_created_gives_a_cold_start(served, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    cache = tmp_path / "a-file" / "cache"
    report = prejob(workload="w", server=served.live.url, cache_dir=cache, timeout_s=10)
    assert report.cold
    assert (report.reason or "").startswith(f"cache_dir_unusable: cannot use {cache} as")
    assert report.exports == {}  # never export a dir the job cannot use


def test_state_folder_as_a_file_fails_pull_cleanly_and_prejob_cold(served, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".cachekeeper").write_bytes(b"someone's file")
    with (
        CacheClient(base_url=served.live.url) as client,
        pytest.raises(CacheDirUnusable, match="not a folder"),
    ):
        pull(client=client, workload="w", cache_dir=cache)
    report = prejob(workload="w", server=served.live.url, cache_dir=cache, timeout_s=10)
    assert report.cold and (report.reason or "").startswith("cache_dir_unusable: "), report
    assert report.snapshot_id == served.manifest.id  # it had found the snapshot to restore
    assert (cache / ".cachekeeper").read_bytes() == b"someone's file"
    assert visible_files(cache) == set()


@pytest.mark.slow  # waits out the hook's 2 s timeout twice
def test_a_hung_server_over_a_restored_dir_says_the_job_uses_what_it_holds(served, relay, tmp_path):
    """Issue 25: with the server hung and the dir already restored, the hook said "this job
    will compile cold", though the job hits what an earlier restore left."""
    cache = tmp_path / "cache"
    assert run_prejob("--server", relay.url, "--cache-dir", str(cache)).returncode == 0
    relay.routes["/"] = stall()
    proc = run_prejob(
        "--server", relay.url, "--cache-dir", str(cache), "--timeout", "2", "--json",
        timeout=20,  # hang guard (10x the hook's timeout; the server never answers)
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "will compile cold" not in line, line
    held = served.manifest.id
    assert f"the cache dir still holds snapshot {held[:12]} from an earlier restore" in line
    report = json.loads(proc.stdout)
    assert report["outcome"] == "cold" and report["held_snapshot_id"] == held
    # an empty dir under the same hung server is a cold start, said as one
    empty = run_prejob("--server", relay.url, "--cache-dir", str(tmp_path / "e"), "--timeout",
                       "2", timeout=20)  # fmt: skip
    assert "this job will compile cold" in empty.stderr, empty.stderr
