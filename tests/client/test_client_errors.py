"""Client errors say which URL refused, which scope it needs, and where a token comes from.

A real server with auth on (uvicorn on 127.0.0.1) and the real CLI in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachekeeper.client.api import CacheClient, server_root
from cachekeeper.client.push import push
from cachekeeper.errors import Forbidden, Unauthorized
from cachekeeper.store import LocalStore
from tests.helpers.caches import make_cache
from tests.helpers.live_server import LiveServer

CK = str(Path(sys.executable).parent / "cachekeeper")


@pytest.fixture(scope="module")
def pushed(authed_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    src = tmp_path_factory.mktemp("src") / "cache"
    make_cache(src)
    home = tmp_path_factory.mktemp("home")
    with CacheClient(base_url=authed_server.url, token="write-token") as client:
        return push(src, client=client, workload="small", store=LocalStore(home=home)).snapshot_id


def ck(*args: str, tmp_path: Path, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_"))
    }
    env["CACHEKEEPER_HOME"] = str(tmp_path / "home")
    if token is not None:
        env["CACHEKEEPER_TOKEN"] = token
    return subprocess.run([CK, *args], capture_output=True, text=True, env=env, timeout=120)


def test_server_root_drops_a_trailing_v1() -> None:
    assert server_root("http://cache:8750/v1/") == "http://cache:8750"
    assert server_root("http://cache:8750/prefix/V1") == "http://cache:8750/prefix"
    assert server_root("http://cache:8750/") == "http://cache:8750"
    assert server_root("http://cache:8750/v10") == "http://cache:8750/v10"


def test_pull_without_a_token_names_url_scope_and_where_tokens_come_from(
    authed_server: LiveServer, pushed: str, tmp_path: Path
) -> None:
    proc = ck("pull", "--workload", "small", "--cache-dir", str(tmp_path / "c"),
              "--server", authed_server.url, tmp_path=tmp_path)  # fmt: skip
    assert proc.returncode == 1
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert f"POST {authed_server.url}/v1/resolve" in line
    assert "'read' scope" in line and "none was given" in line
    assert "--token" in line and "CACHEKEEPER_TOKEN" in line
    assert line.endswith("[unauthorized]")


def test_an_unknown_token_is_named_as_unknown(
    authed_server: LiveServer, pushed: str, tmp_path: Path
) -> None:
    proc = ck("pull", "--workload", "small", "--cache-dir", str(tmp_path / "c"),
              "--server", authed_server.url, tmp_path=tmp_path, token="nope")  # fmt: skip
    assert proc.returncode == 1
    assert "does not know the token given (--token or CACHEKEEPER_TOKEN)" in proc.stderr


def test_push_without_a_token_says_it_needs_the_write_scope(
    authed_server: LiveServer, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    make_cache(src)
    with CacheClient(base_url=authed_server.url) as client, pytest.raises(Unauthorized) as info:
        push(src, client=client, workload="small", store=LocalStore(home=tmp_path / "h"))
    detail = info.value.detail
    assert f"a push to {authed_server.url} needs a token with the 'write' scope" in detail
    assert "--token or CACHEKEEPER_TOKEN" in detail


def test_push_with_a_read_token_names_both_scopes(
    authed_server: LiveServer, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    make_cache(src)
    with (
        CacheClient(base_url=authed_server.url, token="read-token") as client,
        pytest.raises(Forbidden) as info,
    ):
        push(src, client=client, workload="small", store=LocalStore(home=tmp_path / "h"))
    detail = info.value.detail
    assert "needs a token with the 'write' scope" in detail
    assert "has the 'read' scope" in detail
    assert f"{authed_server.url}/v1/" in detail


def test_a_server_url_ending_in_v1_works(
    authed_server: LiveServer, pushed: str, tmp_path: Path
) -> None:
    proc = ck("pull", "--workload", "small", "--cache-dir", str(tmp_path / "c"), "--json",
              "--server", f"{authed_server.url}/v1/", tmp_path=tmp_path, token="read-token")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["snapshot_id"] == pushed


def test_prejob_with_a_v1_url_restores(
    authed_server: LiveServer, pushed: str, tmp_path: Path
) -> None:
    proc = ck("prejob", "--workload", "small", "--cache-dir", str(tmp_path / "c"), "--json",
              "--server", f"{authed_server.url}/v1", tmp_path=tmp_path, token="read-token")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["outcome"] == "restored", report
    assert report["snapshot_id"] == pushed
