"""Issue 25: one fingerprint per snapshot, the one its caches were built with, on every path.

A workload that declares ``[process] omp_num_threads = 1`` is compiled by its children with
1 thread, whatever the builder's shell has. ``cachekeeper agent --once --device cpu`` on this
2-core machine used to publish the snapshot under its own fingerprint (2 threads): it then
won resolve for 2-thread nodes, where every kernel misses, and never for the 1-thread ranks
it was built for. Real CPU compiles (one cold compile of cpu-tiny): the agent builds it, and
the snapshot's fingerprint is compared with what the children compiled under
(``child_cpu_state``), with the CLI path's (``snapshot``/``push`` of a prewarmed dir are in
tests/core/test_snapshot.py and tests/client/test_push.py) and with the nodes that get it:
a 1-thread node restores it and hits with zero misses, a 2-thread node is told why not.
A second ``--once`` resolves with the build's fingerprint and compiles nothing, and the
status shows one warm row for the pair, with the agent's name, and no phantom "missing" row
under the agent's own digest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachekeeper.children import child_cpu_state
from cachekeeper.client.api import CacheClient
from cachekeeper.client.prejob import prejob
from cachekeeper.fingerprint import collect, digest_of
from cachekeeper.server.settings import Settings
from tests.conftest import run_probe
from tests.helpers.live_server import start_server

pytestmark = pytest.mark.compile  # real torch.compile runs in children

REPO = Path(__file__).resolve().parents[2]
TINY = (REPO / "examples" / "workloads" / "cpu-tiny.toml").read_text()
ONE_THREAD = TINY + "\n[process]\nomp_num_threads = 1\n"


def _once(url: str, work: Path) -> dict:
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("cachekeeper")), "agent", "--server", url,
         "--once", "--device", "cpu", "--json", "--work-dir", str(work), "--name", "b1"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 threads")
def test_the_agent_publishes_the_fingerprint_its_children_compiled_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shell_threads: None
) -> None:
    for name in ("CACHEKEEPER_SERVER", "CACHEKEEPER_TOKEN", "CACHEKEEPER_FINGERPRINT_OVERRIDES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CACHEKEEPER_HOME", str(tmp_path / "home"))
    live = start_server(Settings(data_dir=tmp_path / "server"))
    try:
        httpx.put(f"{live.url}/v1/workloads/cpu-tiny", content=ONE_THREAD).raise_for_status()
        report = _once(live.url, tmp_path / "work")
        (outcome,) = report["outcomes"]
        assert outcome["status"] == "built", outcome
        agent_fp = collect()
        assert agent_fp["cpu"]["threads"] == 2  # the builder's own shell
        with CacheClient(base_url=live.url) as client:
            manifest = client.get_manifest(outcome["snapshot_id"])
        built = child_cpu_state(1)
        # The one fingerprint: the children's CPU state, everything else the agent's.
        assert manifest.fingerprint["cpu"] == built and built["threads"] == 1
        assert manifest.fingerprint == {**agent_fp, "cpu": built}
        assert outcome["fingerprint_digest"] == manifest.fingerprint_digest
        assert report["fingerprint_digest"] == digest_of(agent_fp) != manifest.fingerprint_digest

        # A 1-thread node (torchrun's ranks) restores it and hits; a 2-thread one does not.
        ranks = prejob(
            workload="cpu-tiny",
            server=live.url,
            cache_dir=tmp_path / "node-1",
            fingerprint=collect(environ={"OMP_NUM_THREADS": "1"}),
            report=False,
        )
        assert ranks.outcome == "restored", ranks
        counters = run_probe(tmp_path / "node-1", extra_env={"OMP_NUM_THREADS": "1"})
        assert counters["inductor"].get("fxgraph_cache_miss", 0) == 0, counters
        assert counters["inductor"].get("fxgraph_cache_hit", 0) >= 1, counters
        plain = prejob(
            workload="cpu-tiny", server=live.url, cache_dir=tmp_path / "node-2", report=False
        )
        assert plain.outcome == "cold" and "built with 1 threads" in (plain.reason or ""), plain

        # The next round resolves with the build's fingerprint: warm, nothing compiled.
        again = _once(live.url, tmp_path / "work")
        (skipped,) = again["outcomes"]
        assert skipped["status"] == "skipped" and again["prewarms_run"] == 0, skipped
        rows = httpx.get(f"{live.url}/v1/status").json()["status"]
        assert [(r["fingerprint_digest"], r["status"], r["agents"]) for r in rows] == [
            (manifest.fingerprint_digest, "warm", ["b1"])
        ], rows
    finally:
        live.stop()
