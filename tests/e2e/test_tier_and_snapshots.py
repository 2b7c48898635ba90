"""Snapshots stay the first tier when the per-key tier is on, with real CPU compiles.

The tier's AOTAutograd switch is part of torch's AOTAutograd key: a snapshot built without
it misses on a node that runs with it. So a builder runs with the switches nodes get (the
agent sets them from ``GET /v1/remote-cache``; here the CLI runs in that environment), the
fingerprint records them, and the hook exports exactly the switches its snapshot was
ranked for:

1. prewarm (by hand: the CLI asks the server for the switches, as the agent does) + push
   cpu-tiny with the switches, prejob into an empty dir (the tier on):
   verify in the job's environment hits with zero misses, and the tier is asked for
   nothing the snapshot holds; the same dir verified without the switches misses (the
   control: the switch really is in the key, so the test above can fail);
2. a snapshot built before the tier was on (no switch) still serves a node with the tier
   on: the hook then leaves the keyed switch out, and the restored dir hits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachekeeper import remote_tier
from cachekeeper.server.settings import Settings
from tests.conftest import TINY, run_probe
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.redis_py import redis_py_env, redis_py_versions

pytestmark = [
    pytest.mark.compile,  # real torch.compile runs against the tier
    pytest.mark.usefixtures("redis_py"),  # fails, never skips, without redis-py
]

CK = str(Path(sys.executable).parent / "cachekeeper")
TOKENS = {"builder": "write", "node": "read"}


def base_env(handle: LiveServer, home: Path, token: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "CACHEKEEPER_"))
    }
    remote_tier.set_builder_switches(env, {})
    env.update(
        CACHEKEEPER_SERVER=handle.url,
        CACHEKEEPER_TOKEN=token,
        CACHEKEEPER_HOME=str(home),
        **redis_py_env(redis_py_versions()[-1]),
    )
    return env


def ck(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CK, *args], env=env, capture_output=True, text=True, timeout=600)


def prejob_exports(env: dict[str, str], workload: str, cache: Path) -> dict[str, str]:
    proc = ck(
        env, "prejob", "--workload", workload, "--cache-dir", str(cache), "--json", "--strict"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["outcome"] == "restored", report
    return dict(report["exports"])


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    data = tmp_path_factory.mktemp("tier-snap") / "data"
    handle = start_server(Settings(data_dir=data, tokens=TOKENS, resp_port=0))
    yield handle
    handle.stop()


def test_a_snapshot_built_with_the_switches_hits_on_a_node_with_the_tier_on(
    tier: LiveServer, tmp_path: Path
) -> None:
    builder = base_env(tier, tmp_path / "builder-home", "builder")
    answer = httpx.get(f"{tier.url}/v1/remote-cache", headers={"Authorization": "Bearer builder"})
    offer = answer.json()
    assert answer.status_code == 200 and offer["switches"] == remote_tier.site_switches(tier=True)
    # a prewarm by hand (issue 30, "no half tier"): the CLI asks CACHEKEEPER_SERVER for the
    # tier's switches itself, as the agent does, and says so
    built = tmp_path / "built"
    proc = ck(builder, "prewarm", str(TINY), "--cache-dir", str(built), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "running with the per-key tier's switches" in proc.stderr, proc.stderr[-2000:]
    proc = ck(builder, "push", str(built), "--workload", "cpu-tiny", "--allow-unregistered")
    assert proc.returncode == 0, proc.stderr[-3000:]

    node = base_env(tier, tmp_path / "node-home", "node")
    cache = tmp_path / "node-cache"
    exports = prejob_exports(node, "cpu-tiny", cache)
    assert exports[remote_tier.AOTAUTOGRAD] == "1" and exports[remote_tier.FX_GRAPH] == "1"
    # cachekeeper's own backend (torch 2.13, a server that serves /v1/tier): no token in a URL
    assert exports["CACHEKEEPER_TIER_MODE"] == "cachekeeper", exports
    assert exports[remote_tier.URL] == remote_tier.OFF_URL
    gets = tier.app.state.metrics.value("cachekeeper_remote_cache_gets_total", result="miss")

    job = {**node, **exports}
    proc = ck(job, "verify", str(TINY), "--cache-dir", str(cache), "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        tier.app.state.metrics.value("cachekeeper_remote_cache_gets_total", result="miss") == gets
    )

    # The control: the same restored dir, run without the switch (no server to ask for
    # it), misses its AOTAutograd entry.
    proc = ck(node, "verify", str(TINY), "--cache-dir", str(cache), "--device", "cpu", "--json",
              "--server", "")  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(proc.stdout)["devices"]
    assert runs[0]["counters"].get("autograd_cache_miss", 0) >= 1, runs


def test_a_snapshot_built_before_the_tier_was_on_still_serves_a_node_with_it(
    tier: LiveServer, tmp_path: Path, compiled_cache: Path
) -> None:
    builder = base_env(tier, tmp_path / "builder-home", "builder")
    proc = ck(
        builder,
        "push",
        str(compiled_cache),
        "--workload",
        "flex-before-tier",
        "--allow-unregistered",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    node = base_env(tier, tmp_path / "node-home", "node")
    cache = tmp_path / "node-cache"
    exports = prejob_exports(node, "flex-before-tier", cache)
    assert remote_tier.AOTAUTOGRAD not in exports  # the snapshot's keys have no switch
    assert exports[remote_tier.FX_GRAPH] == "1"  # the rest of the tier is still on
    counters = run_probe(cache, extra_env={**redis_py_env(redis_py_versions()[-1]), **exports})
    assert counters["inductor"].get("fxgraph_cache_miss", 0) == 0, counters
    assert counters["aot_autograd"].get("autograd_cache_miss", 0) == 0, counters
