"""One server per data dir (issue 24): a second ``cachekeeper serve`` on the same ``--data``
would race the first one's GC and delete blob files of listed snapshots, so it refuses to
start, in one line naming the holder. Real server processes on loopback."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from tests.hardening.conftest import ServerProcess, child_env, cli
from tests.helpers.ports import free_port


def _second(data_dir: Path, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli("serve", "--port", str(free_port()), "--data", str(data_dir)),
        env=child_env(home, CACHEKEEPER_LOG_LEVEL="warning"),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_second_server_on_the_same_data_dir_refuses_to_start(
    server_process: ServerProcess, tmp_path: Path, reliability
) -> None:
    first = server_process.start()
    started = time.monotonic()
    second = _second(first.data_dir, tmp_path / "home2")
    assert second.returncode != 0, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert "is in use by another cachekeeper server" in lines[0], lines[0]
    assert f"pid {first.proc.pid}" in lines[0], lines[0]  # type: ignore[union-attr]
    assert time.monotonic() - started < 30
    assert httpx.get(f"{first.url}/healthz", timeout=5).status_code == 200  # untouched
    first.kill()  # the lock goes with the process, however it ends
    third = ServerProcess(data_dir=first.data_dir, home=tmp_path / "home3").start()
    try:
        assert httpx.get(f"{third.url}/healthz", timeout=5).status_code == 200
    finally:
        third.kill()
    reliability.record(
        "a second `cachekeeper serve` on the data dir of a running one: refused at start-up in"
        " one line naming the holder's pid; after the first is SIGKILLed a new one starts",
        tries=1,
        outcome="refused",
        area="configuration",
    )
