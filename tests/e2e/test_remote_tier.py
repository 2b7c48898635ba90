"""The per-key tier end to end: real CPU compiles of flex_attention against the server's
RESP port, through each redis-py version torch users have (installed by scripts/setup).

Process A compiles with an empty local dir and puts every FX graph and AOTAutograd entry
into the tier; a fresh process B with another empty dir gets them all back: every entry a
hit, zero misses, the tier alone serving it. Each version puts once and gets once (A with
one, B with the other, then the other way round on a second regime), so a handshake or a
reply one version parses differently fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachekeeper import remote_tier
from cachekeeper.server.settings import Settings
from tests.conftest import PROBE
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.redis_py import redis_py_env, redis_py_versions

pytestmark = [
    pytest.mark.compile,  # real torch.compile runs against the tier
    pytest.mark.usefixtures("redis_py"),  # fails, never skips, without redis-py
]

TOKENS = {"node-write": "write"}


def node_env(handle: LiveServer, cache_dir: Path, version: str) -> dict[str, str]:
    """What ``prejob`` exports for a node on this tier, plus the redis-py to use."""
    url = remote_tier.tier_url(
        handle.url, port=int(handle.resp_port or 0), token="node-write", name="ck:test:0"
    )
    return {
        **os.environ,
        **remote_tier.job_environ(remote_tier.site_switches(tier=True), url=url),
        **redis_py_env(version),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
    }


def run_job(env: dict[str, str], *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(PROBE), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def drained(handle: LiveServer) -> None:
    """Wait until every accepted SET is stored (they are answered before they are)."""
    deadline = time.monotonic() + 30
    while handle.app.state.resp._writer.pending:
        assert time.monotonic() < deadline, "the tier did not store what it accepted"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("tier-e2e") / "data"
    with start_server(Settings(data_dir=data, tokens=TOKENS, resp_port=0)) as handle:
        yield handle


@pytest.mark.parametrize(("writer", "reader", "seq"), [(0, 1, "128"), (1, 0, "256")])
def test_a_fresh_process_with_an_empty_dir_hits_every_entry_through_the_tier_alone(
    tier: LiveServer, tmp_path: Path, writer: int, reader: int, seq: str
) -> None:
    versions = redis_py_versions()
    put_with, get_with = versions[0 if writer == 0 else -1], versions[0 if reader == 0 else -1]
    metrics = tier.app.state.metrics
    hits_before = metrics.value("cachekeeper_remote_cache_gets_total", result="hit")

    a = run_job(node_env(tier, tmp_path / "a", put_with), seq)
    assert a["inductor"].get("fxgraph_cache_miss", 0) >= 1, a  # A compiled: cold
    assert a["aot_autograd"].get("autograd_cache_miss", 0) >= 1, a
    drained(tier)

    b = run_job(node_env(tier, tmp_path / "b", get_with), seq)
    assert b["inductor"].get("fxgraph_cache_miss", 0) == 0, b
    assert b["aot_autograd"].get("autograd_cache_miss", 0) == 0, b
    assert b["inductor"].get("fxgraph_cache_hit", 0) >= 1, b
    assert b["aot_autograd"].get("autograd_cache_hit", 0) >= 1, b
    # The hits came from the tier: B's dir was empty, and the tier answered them.
    hits = metrics.value("cachekeeper_remote_cache_gets_total", result="hit") - hits_before
    assert hits >= b["inductor"]["fxgraph_cache_hit"] + b["aot_autograd"]["autograd_cache_hit"]
