"""Harvesting what a job compiled (issue 15): real CPU compiles, a real server, two nodes.

The workload's snapshot is the session's ``compiled_cache`` (flex_attention at seq 128).
The job on node A calls seq 256, which the workload did not list: it compiles it (the one
extra cold compile of this module). ``postjob --push`` harvests it as a delta of the
restored snapshot; on a fresh node B, ``prejob`` restores the snapshot and then the delta,
and seq 256 runs with zero FX-graph misses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.postjob import postjob
from cachekeeper.client.prejob import prejob
from cachekeeper.client.push import push
from cachekeeper.fingerprint import collect
from cachekeeper.restore import is_restored
from cachekeeper.server.settings import Settings
from tests.conftest import PROBE
from tests.helpers.live_server import TOKENS, start_server


def probe(cache_dir: Path, seq: int) -> dict:
    """flex_attention at ``seq`` in a fresh process on ``cache_dir``; its counters."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(seq)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("server")
    server = start_server(Settings(data_dir=data, tokens=TOKENS, serve_harvested=True))
    yield server
    server.stop()


def test_a_harvested_shape_is_a_hit_on_the_next_fresh_node(
    live, compiled_cache: Path, tmp_path: Path
) -> None:
    fingerprint = collect()
    with CacheClient(base_url=live.url, token="write-token") as client:
        base = push(compiled_cache, client=client, workload="flex", fingerprint=fingerprint)

    node_a = tmp_path / "node-a"
    pre_a = prejob(workload="flex", server=live.url, token="read-token", cache_dir=node_a)
    assert pre_a.outcome == "restored", pre_a
    job = probe(node_a, 256)  # a shape the workload did not list
    assert job["inductor"].get("fxgraph_cache_miss", 0) >= 1, job

    harvest = postjob(
        workload="flex", server=live.url, token="write-token", cache_dir=node_a, push=True
    )
    assert harvest.outcome == "compiled" and harvest.snapshot_id == base.snapshot_id
    assert harvest.entries["fxgraph"] >= 1 and harvest.warning is None, harvest
    delta_id = harvest.pushed_snapshot_id
    assert delta_id is not None

    with httpx.Client(base_url=live.url, headers={"Authorization": "Bearer read-token"}) as c:
        manifest = c.get(f"/v1/snapshots/{delta_id}").json()
        answer = c.post("/v1/resolve", json={"fingerprint": fingerprint, "workload": "flex"}).json()
    assert manifest["source"] == "harvest" and manifest["parent"] == base.snapshot_id
    assert answer["snapshot"]["id"] == base.snapshot_id  # the delta is never the snapshot
    assert [d["id"] for d in answer["deltas"]] == [delta_id]
    assert answer["deltas"][0]["verified"] is False

    node_b = tmp_path / "node-b"
    pre_b = prejob(workload="flex", server=live.url, token="read-token", cache_dir=node_b)
    assert pre_b.outcome == "restored", pre_b
    assert is_restored(base.snapshot_id, node_b) and is_restored(delta_id, node_b)
    again = probe(node_b, 256)
    assert again["inductor"].get("fxgraph_cache_miss", 0) == 0, again
    assert again["inductor"].get("fxgraph_cache_hit", 0) >= 1, again

    # The fresh node ran only hits: its own postjob counts nothing new.
    after = postjob(workload="flex", server=live.url, token="read-token", cache_dir=node_b)
    assert after.outcome == "clean", after
    # And the no-op path sees both restored.
    noop = prejob(workload="flex", server=live.url, token="read-token", cache_dir=node_b)
    assert noop.outcome == "already_restored", noop
