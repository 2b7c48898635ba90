"""cachekeeper's own remote-cache backend end to end: real compiles, a real server, prejob's
exports, a job's Python without redis-py, and postjob's count of what the job did.

Node A (an empty dir) runs ``prejob`` against a server that serves the tier and has no
snapshot of the workload, then a job (tests/tier_job.py: two small torch.compile calls)
with prejob's exports: its Python cannot import ``redis`` (proved first), so torch's stock
path would give it nothing; the backend puts every FX graph and AOTAutograd entry. A fresh
node B with another empty dir then hits every one of them through the tier alone, 0
misses, and postjob counts them as the tier's. A node with a read token is told its
writes are off, and its puts never reach the server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachekeeper import config, remote_tier
from cachekeeper.client.postjob import postjob
from cachekeeper.client.prejob import prejob
from cachekeeper.server.settings import Settings
from tests.conftest import REPO
from tests.helpers.live_server import LiveServer, start_server

pytestmark = [pytest.mark.compile]  # real torch.compile runs through the backend

JOB = REPO / "tests" / "tier_job.py"
TOKENS = {"node-write": "write", "node-read": "read"}


def node_env(exports: dict[str, str], home: Path) -> dict[str, str]:
    """A node's job environment: this Python (no redis-py on its path), prejob's exports."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHINDUCTOR_", "CACHEKEEPER_")) and k != "PYTHONPATH"
    }
    return {**env, **exports, "CACHEKEEPER_HOME": str(home)}


def run_job(env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, str(JOB)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("tier-backend") / "data"
    with start_server(Settings(data_dir=data, tokens=TOKENS, resp_port=0)) as handle:
        yield handle


def node_prejob(
    tier: LiveServer, cache: Path, home: Path, token: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("CACHEKEEPER_HOME", str(home))
    return prejob(
        workload="no-snapshot",
        server=tier.url,
        token=token,
        cache_dir=cache,
        report=False,
        tier_timeout_s=10.0,  # the loaded 2-core VM: a fault here would be the machine's
    )


def test_a_fresh_node_whose_python_has_no_redis_py_hits_every_entry_through_the_tier(
    tier: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    a = node_prejob(tier, tmp_path / "a", home, "node-write", monkeypatch)
    assert a.remote_cache == "on" and a.remote_cache_backend == "cachekeeper", a
    assert a.remote_cache_note is not None and a.remote_cache_note.endswith("reads and writes")
    env_a = node_env(a.exports, home)
    # the token is in a 0600 file, never in an exported value
    assert all("node-write" not in value for value in a.exports.values())
    token_file = Path(a.exports[config.TIER_TOKEN_FILE])
    assert token_file.read_text() == "node-write" and token_file.stat().st_mode & 0o777 == 0o600
    # the fault this test is about: the job's Python cannot import redis-py
    no_redis = subprocess.run(
        [sys.executable, "-c", "import redis"], env=env_a, capture_output=True, text=True
    )
    assert no_redis.returncode != 0 and "No module named 'redis'" in no_redis.stderr

    first = run_job(env_a)
    assert first["inductor"].get("fxgraph_cache_miss", 0) == 2, first  # A compiled: cold
    assert first["remote"]["backend:CachekeeperTierBackend"]["put"] >= 4, first
    count_a = postjob(workload="no-snapshot", server=None, cache_dir=tmp_path / "a", report=False)
    assert count_a.tier is not None and count_a.tier.puts >= 4 and count_a.tier.problem is None

    b = node_prejob(tier, tmp_path / "b", home, "node-write", monkeypatch)
    hits_before = tier.app.state.metrics.value("cachekeeper_remote_cache_gets_total", result="hit")
    second = run_job(node_env(b.exports, home))
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second
    assert second["aot_autograd"].get("autograd_cache_miss", 0) == 0, second
    assert second["inductor"]["fxgraph_cache_hit"] == 2, second
    assert second["aot_autograd"]["autograd_cache_hit"] == 2, second
    hits = tier.app.state.metrics.value("cachekeeper_remote_cache_gets_total", result="hit")
    assert hits - hits_before >= 4  # B's dir was empty: the tier answered them
    count_b = postjob(workload="no-snapshot", server=None, cache_dir=tmp_path / "b", report=False)
    assert count_b.tier is not None, count_b
    assert (count_b.tier.tier_hits, count_b.tier.snapshot_hits, count_b.tier.failed) == (4, 0, 0)
    assert count_b.tier.problem is None
    print(f"node B through the tier alone: {count_b.tier.line()}")


def test_a_read_token_node_is_told_its_writes_are_off_and_puts_nothing(
    tier: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    done = node_prejob(tier, tmp_path / "r", home, "node-read", monkeypatch)
    assert done.remote_cache == "on" and not done.remote_cache_writes
    assert done.remote_cache_note is not None
    assert "reads only: the token has the read scope" in done.remote_cache_note
    assert done.exports[config.TIER_WRITES] == "0"
    stored = tier.app.state.metrics.value("cachekeeper_remote_cache_puts_total", result="stored")
    out = subprocess.run(
        [sys.executable, "-c", "import torch; f = torch.compile(lambda t: t * 3 + 1);"
         " print(f(torch.ones(8)).sum().item())"],
        env=node_env(done.exports, home), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    after = tier.app.state.metrics.value("cachekeeper_remote_cache_puts_total", result="stored")
    assert after == stored  # nothing written by a read-token node
    assert remote_tier.OFF_URL == done.exports[remote_tier.URL]  # no redis URL with a token
