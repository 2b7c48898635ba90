"""Issue 17.4: the CPU thread count is in Inductor's key, so it is in the fingerprint.

torchrun sets ``OMP_NUM_THREADS=1``; a cache compiled with the builder's thread count then
misses on every rank. Real CPU compiles of examples/workloads/cpu-tiny.toml (two cold
compiles in all): a prewarm whose workload declares ``[process] omp_num_threads = 1``
(its verify hits with 1 thread), and a verify of the same cache with 2 threads, which
misses. The snapshot of the dir records 1 thread, and ``explain`` names the difference.
Needs at least 2 CPUs (a 1-CPU process has 1 thread whatever it asks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachekeeper.builder.prewarm import prewarm
from cachekeeper.builder.verify import verify
from cachekeeper.builder.workload import parse_workload
from cachekeeper.cli import cli
from cachekeeper.environment import cpu
from cachekeeper.environment.fingerprint import collect, compare, format_mismatches, unchecked
from cachekeeper.snapshot.make import snapshot_dir
from cachekeeper.snapshot.provenance import load_prewarm_record
from cachekeeper.store import LocalStore

pytestmark = pytest.mark.compile  # real torch.compile runs in children

REPO = Path(__file__).resolve().parents[2]
TINY = (REPO / "examples" / "workloads" / "cpu-tiny.toml").read_text()


def _explain(snapshot_id: str, threads: str) -> tuple[int, dict[str, object]]:
    result = CliRunner().invoke(
        cli, ["explain", snapshot_id, "--device", "cpu", "--json"], env={"OMP_NUM_THREADS": threads}
    )
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 threads")
def test_thread_count_misses_and_a_declared_one_hits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shell_threads: None
) -> None:
    monkeypatch.setenv("CACHEKEEPER_HOME", str(tmp_path / "home"))
    cache = tmp_path / "cache"
    declared = parse_workload(TINY + "\n[process]\nomp_num_threads = 1\n", source="t.toml")
    assert declared.omp_num_threads == 1 and declared.name == "cpu-tiny"

    # 1. prewarm as training's ranks run: 1 thread; its verify (1 thread) hits
    report = prewarm(declared, cache, devices=["cpu"])
    assert report.verify is not None and report.verify.effective, report.to_dict()
    record = load_prewarm_record(cache, "cpu-tiny")
    assert record is not None and record["cpu"]["threads"] == 1

    # 2. the same cache under this shell's 2 threads (no [process]): every regime misses
    plain = parse_workload(TINY, source="cpu-tiny.toml")
    two = verify(plain, cache, devices=["cpu"])
    misses = sum(run.counters.get("fxgraph_cache_miss", 0) for run in two.devices)
    assert not two.effective and misses >= 1, two.to_dict()

    # 3. the snapshot records what the prewarm compiled with, not this shell's 2 threads
    manifest = snapshot_dir(cache, store=LocalStore())
    assert manifest.workload == "cpu-tiny" and manifest.verified  # 17.5: like push
    assert manifest.fingerprint["cpu"]["threads"] == 1
    node = collect()
    assert node["cpu"]["threads"] == 2
    found = compare(node, manifest.fingerprint, devices=list(manifest.devices))
    assert [m.field for m in found] == ["cpu"]
    text = format_mismatches(found)
    assert "built with 1 threads (OMP_NUM_THREADS=1)" in text
    assert "this job has 2 (2 cpus this process may use)" in text
    assert "omp_num_threads = 2" in text

    # 4. explain: suits a job with OMP_NUM_THREADS=1 (torchrun's), names 2 threads
    code, body = _explain(manifest.id, "1")
    assert code == 0 and body["compatible"] is True and body["unchecked"] == [], body
    code, body = _explain(manifest.id, "2")
    assert code == 1 and [m["field"] for m in body["mismatches"]] == ["cpu"], body  # type: ignore[index,union-attr]
    assert "this job has 2 (OMP_NUM_THREADS=2)" in str(body["mismatches"])


def test_old_fingerprint_without_cpu_is_reported_not_a_crash() -> None:
    """A schema-1 snapshot (no ``cpu``) still matches; ``unchecked`` names what was skipped."""
    node = collect(environ={"OMP_NUM_THREADS": "1"})
    old = {k: v for k, v in node.items() if k != "cpu"} | {"schema": 1}
    assert compare(node, old, devices=["cpu"]) == []
    runner_fp = dict(node, cpu=cpu.with_threads(node["cpu"], 3))
    assert [m.field for m in compare(node, runner_fp, devices=["cpu"])] == ["cpu"]
    # a GPU snapshot has no CPU kernels to miss
    assert compare(node, runner_fp, devices=["cuda:0"], node_devices=["cuda:0"]) == []
    assert unchecked(node, old, devices=["cpu"]) == ["cpu"]
    assert unchecked(node, old, devices=["cuda:0"]) == []
