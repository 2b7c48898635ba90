"""push / pull / prejob end to end: the real server (uvicorn on 127.0.0.1), the real CLI.

The flex_attention cache is a real CPU compile (``compiled_cache``); the final proof is a
fresh process on the restored dir with zero FX-graph misses.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.push import push
from cachekeeper.fingerprint import collect
from cachekeeper.restore import is_restored
from cachekeeper.store import LocalStore
from tests.conftest import run_probe
from tests.e2e.conftest import CK, ck, counter
from tests.helpers.caches import make_cache


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ck-home")


def _push_flex(cache: Path, url: str, home: Path) -> subprocess.CompletedProcess[str]:
    """``cachekeeper push CACHE --workload flex --json`` (unregistered) with the write token."""
    return ck("push", str(cache), "--workload", "flex", "--allow-unregistered", "--json",
              server=url, home=home)  # fmt: skip


@pytest.fixture(scope="module")
def pushed_flex(authed_server, home, compiled_cache) -> dict:
    """The real compiled cache pushed as workload 'flex' (the first push's JSON report)."""
    proc = _push_flex(compiled_cache, authed_server.url, home)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_push_twice_uploads_nothing_the_second_time(
    authed_server, home, compiled_cache, pushed_flex
):
    assert pushed_flex["created"] is True
    assert pushed_flex["uploaded_blobs"] == pushed_flex["blob_count"] > 0
    proc = _push_flex(compiled_cache, authed_server.url, home)
    assert proc.returncode == 0, proc.stderr
    again = json.loads(proc.stdout)
    assert again["snapshot_id"] == pushed_flex["snapshot_id"]
    assert again["created"] is False
    assert again["uploaded_blobs"] == 0 and again["uploaded_bytes"] == 0
    assert again["deduplicated_blobs"] == pushed_flex["blob_count"]


@pytest.mark.slow
def test_prejob_restores_a_cache_a_fresh_process_hits(authed_server, home, pushed_flex, tmp_path):
    cache = tmp_path / "node-cache"
    proc = ck("prejob", "--workload", "flex", "--cache-dir", str(cache), "--strict",
              server=authed_server.url, token="read-token", home=home)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={cache}\n"
    assert is_restored(pushed_flex["snapshot_id"], cache)
    counters = run_probe(cache)
    assert counters["inductor"].get("fxgraph_cache_miss", 0) == 0, counters
    assert counters["inductor"].get("fxgraph_cache_hit", 0) >= 1, counters


@pytest.fixture(scope="module")
def pushed_small(authed_server, home, tmp_path_factory) -> str:
    src = tmp_path_factory.mktemp("small") / "cache"
    make_cache(src)
    proc = ck(
        "push",
        str(src),
        "--workload",
        "small",
        "--allow-unregistered",
        "--json",
        server=authed_server.url,
        home=home,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["snapshot_id"]


def test_pull_fetches_only_what_the_dir_lacks(authed_server, home, pushed_small, tmp_path):
    cache = tmp_path / "cache"
    proc = ck("pull", "--workload", "small", "--cache-dir", str(cache), "--json",
              server=authed_server.url, token="read-token", home=home)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    first = json.loads(proc.stdout)
    assert first["outcome"] == "restored" and first["blobs_fetched"] == 4
    (cache / "cd" / "kernel.py").unlink()
    proc = ck("pull", "--workload", "small", "--cache-dir", str(cache), "--json",
              server=authed_server.url, token="read-token", home=home)  # fmt: skip
    second = json.loads(proc.stdout)
    assert second["outcome"] == "restored" and second["blobs_fetched"] == 1
    assert is_restored(pushed_small, cache)


@pytest.mark.slow  # eight hook processes
def test_eight_concurrent_prejobs_fetch_one_set(authed_server, home, pushed_small, tmp_path):
    cache = tmp_path / "shared-cache"
    archives = counter(authed_server.url, "cachekeeper_archive_requests_total")
    blob_gets = counter(authed_server.url, "cachekeeper_blob_downloads_total")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(CACHEKEEPER_SERVER=authed_server.url, CACHEKEEPER_TOKEN="read-token")
    procs = [
        subprocess.Popen(
            [CK, "prejob", "--workload", "small", "--cache-dir", str(cache), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for _ in range(8)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    outcomes = sorted(r["outcome"] for r in reports)
    assert outcomes == ["already_restored"] * 7 + ["restored"], outcomes
    assert counter(authed_server.url, "cachekeeper_archive_requests_total") - archives == 1
    assert counter(authed_server.url, "cachekeeper_blob_downloads_total") - blob_gets == 0
    assert is_restored(pushed_small, cache)


@pytest.mark.parametrize("token", [None, "not-a-token"], ids=["missing", "wrong"])
def test_prejob_without_a_valid_token_compiles_cold(
    authed_server, home, pushed_small, tmp_path, token
):
    proc = ck("prejob", "--workload", "small", "--cache-dir", str(tmp_path / "c"),
              server=authed_server.url, token=token, home=home)  # fmt: skip
    assert proc.returncode == 0
    assert (
        proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        and "refused the token" in proc.stderr
    )
    assert "export TORCHINDUCTOR_CACHE_DIR=" in proc.stdout
    proc = ck("prejob", "--workload", "small", "--cache-dir", str(tmp_path / "c"), "--strict",
              server=authed_server.url, token=token, home=home)  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == ""


def test_push_with_a_read_token_is_forbidden(authed_server, home, tmp_path):
    src = tmp_path / "src"
    make_cache(src)
    proc = ck("push", str(src), "--workload", "small", "--allow-unregistered", server=authed_server.url, token="read-token",
              home=home)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "[forbidden]" in proc.stderr


def test_no_match_names_the_mismatched_field(authed_server, home, tmp_path):
    src = tmp_path / "src"
    make_cache(src)
    node = collect()
    other = dict(node, torch="2.11.0+cu130")
    with CacheClient(base_url=authed_server.url, token="write-token") as client:
        push(src, client=client, workload="elsewhere", store=LocalStore(home=home),
             fingerprint=other)  # fmt: skip
    proc = ck("prejob", "--workload", "elsewhere", "--cache-dir", str(tmp_path / "c"),
              server=authed_server.url, token="read-token", home=home)  # fmt: skip
    assert proc.returncode == 0
    assert f"torch {node['torch']} != 2.11.0+cu130" in proc.stderr, proc.stderr
    assert "this job will compile cold" in proc.stderr
    proc = ck("pull", "--workload", "elsewhere", "--cache-dir", str(tmp_path / "c"),
              server=authed_server.url, token="read-token", home=home)  # fmt: skip
    assert proc.returncode == 1
    assert "[no_match]" in proc.stderr and "torch" in proc.stderr
