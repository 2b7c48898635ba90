"""A miss names its real reason: an unknown workload, a workload with no snapshot yet.

The real server (uvicorn on 127.0.0.1) and the real hook process: ``prejob --workload typo``
must say that no workload 'typo' is registered, not that no snapshot matches this node,
and still exit 0 with its exports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers.live_server import LiveServer

CK = str(Path(sys.executable).parent / "cachekeeper")


def ck(*args: str, live: LiveServer, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_"))
    }
    env.update(CACHEKEEPER_SERVER=live.url, CACHEKEEPER_HOME=str(tmp_path / "home"))
    return subprocess.run([CK, *args], capture_output=True, text=True, env=env, timeout=120)


def test_prejob_with_an_unregistered_workload_says_so(
    tiny_server: LiveServer, tmp_path: Path
) -> None:
    proc = ck("prejob", "--workload", "typo", "--cache-dir", str(tmp_path / "c"),
              live=tiny_server, tmp_path=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "no workload 'typo' is registered" in proc.stderr, proc.stderr
    assert "matches this node" not in proc.stderr
    assert "this job will compile cold" in proc.stderr
    assert proc.stdout.startswith("export TORCHINDUCTOR_CACHE_DIR=")


def test_prejob_of_a_registered_workload_without_snapshot_says_so(
    tiny_server: LiveServer, tmp_path: Path
) -> None:
    proc = ck("prejob", "--workload", "cpu-tiny", "--cache-dir", str(tmp_path / "c"),
              live=tiny_server, tmp_path=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "workload 'cpu-tiny' has no snapshot yet" in proc.stderr, proc.stderr


def test_pull_of_an_unregistered_workload_fails_naming_it(
    tiny_server: LiveServer, tmp_path: Path
) -> None:
    proc = ck("pull", "--workload", "typo", "--cache-dir", str(tmp_path / "c"),
              live=tiny_server, tmp_path=tmp_path)  # fmt: skip
    assert proc.returncode == 1
    assert "no workload 'typo' is registered" in proc.stderr, proc.stderr
    assert not (tmp_path / "c").exists()


def test_resolve_answers_the_reason_field(tiny_server: LiveServer) -> None:
    body = {"fingerprint": {"torch": "x"}, "workload": "typo"}
    answer = httpx.post(f"{tiny_server.url}/v1/resolve", json=body).json()
    assert answer["snapshot"] is None
    assert "no workload 'typo' is registered" in answer["reason"]
