"""Command workloads end to end (issue 23): the site's own launcher, proven per rank.

A real ``torchrun --nproc-per-node 2`` (gloo, CPU) runs tests/programs/train_block.py,
whose ranks each compile a small block that calls flex_attention (forward under no_grad).
On one real server, in order:

1. an agent without ``--allow`` refuses the workload (nothing runs; status says refused);
2. an agent with ``--allow`` builds it: a cold run, a verify in a fresh copy with every
   rank hitting, a push; the snapshot covers ``cpu``;
3. a fresh node's ``prejob`` restores it and the node's real torchrun job hits with 0
   misses on both ranks (the job's own counters, not cachekeeper's);
4. that node then runs a longer sequence than the workload lists, ``postjob --push``
   harvests it and says the server keeps it back; the next agent round builds the workload
   again itself (a harvest is a hint, never bytes a builder loads or signs), finds that its
   own run does not compile the harvested entries, publishes nothing and says why (the
   positive case, a launcher that now reaches the shape, is
   tests/hardening/test_trusted_builds.py);
5. a command that crashes only cold is ``cold_compile_broken`` with the rank's exception;
   one that fails on a usage error before compiling is ``command_failed`` with that line;
6. a rank that compiles another shape fails verify, and the verdict names the rank.

About 3 minutes of compiles on two cores (each cold run compiles once per rank in
parallel).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachekeeper.server.settings import Settings
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.requires import require

pytestmark = pytest.mark.compile  # real torch.compile runs in children

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CK = str(BIN / "cachekeeper")
TORCHRUN = str(BIN / "torchrun")
PROGRAM = REPO / "tests" / "programs" / "train_block.py"


def _toml(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    argv = [TORCHRUN, "--nproc-per-node", "2", "--standalone", str(PROGRAM), *args]
    lines = [f'name = "{name}"', "[[command]]", f"argv = {json.dumps(argv)}", 'timeout = "10m"']
    if env:
        lines.append(
            "env = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }"
        )
    return "\n".join(lines) + "\n"


BLOCK = _toml("block")
# The operator's --allow: the launcher with exactly these arguments (issue 32: one glob per
# argument, no wildcard that spans them).
ALLOW_BLOCK = f"{TORCHRUN} --nproc-per-node 2 --standalone {PROGRAM}"


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CACHEKEEPER_") and k != "TORCHINDUCTOR_CACHE_DIR"
    }
    # torchrun gives each of its ranks OMP_NUM_THREADS=1, and CPU kernels are keyed on the
    # thread count: the node's hook runs with the ranks' count, as docs/hooks.md says.
    env.update(CACHEKEEPER_HOME=str(home), OMP_NUM_THREADS="1", **extra)
    return env


def _ck(
    *args: str, home: Path, env: dict[str, str] | None = None, **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CK, *args], capture_output=True, text=True, env=env or _env(home, **extra), timeout=900
    )


def _agent(live: LiveServer, work: Path, *allow: str) -> tuple[dict[str, Any], str]:
    # The agent runs with the builder's own thread count (2 here): what the command's ranks
    # compile with (1 each, from torchrun) is only known once they ran.
    env = _env(work.parent)
    env.pop("OMP_NUM_THREADS")
    proc = _ck("agent", "--server", live.url, "--once", "--device", "cpu", "--json",
               "--work-dir", str(work), *allow, home=work.parent, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    return json.loads(line), proc.stderr


def _job(cache_dir: Path, report: Path, *args: str) -> dict[int, dict[str, int]]:
    """The node's training job: real torchrun on ``cache_dir``; each rank's own counters."""
    env = _env(cache_dir.parent, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    env.pop("OMP_NUM_THREADS")  # torchrun sets it for its ranks itself
    proc = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "--standalone", str(PROGRAM),
         "--report", str(report), *args],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r: json.loads((report / f"rank-{r}.json").read_text()) for r in (0, 1)}


def _prejob(live: LiveServer, cache_dir: Path) -> str:
    proc = _ck("prejob", "--workload", "block", "--server", live.url, "--cache-dir",
               str(cache_dir), home=cache_dir.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"export TORCHINDUCTOR_CACHE_DIR={shlex.quote(str(cache_dir))}" in proc.stdout
    return proc.stderr


def _rows(live: LiveServer) -> dict[str, dict[str, Any]]:
    return {r["workload"]: r for r in httpx.get(f"{live.url}/v1/status").json()["status"]}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    require("torch")
    with start_server(Settings(data_dir=tmp_path_factory.mktemp("server"))) as handle:
        httpx.put(f"{handle.url}/v1/workloads/block", content=BLOCK).raise_for_status()
        yield handle


@pytest.fixture(scope="module")
def built(live: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One agent round with the launcher allowed: its outcome for ``block``."""
    work = tmp_path_factory.mktemp("builder") / "work"
    report, _ = _agent(live, work, "--allow", ALLOW_BLOCK)
    (outcome,) = report["outcomes"]
    return outcome


@pytest.fixture(scope="module")
def node(live: LiveServer, built: dict[str, Any], tmp_path_factory: pytest.TempPathFactory):
    """A fresh node: prejob into an empty dir, then its real torchrun job there."""
    cache_dir = tmp_path_factory.mktemp("node-a") / "inductor"
    said = _prejob(live, cache_dir)
    return cache_dir, said, _job(cache_dir, cache_dir.parent / "report")


def test_an_agent_runs_no_command_its_operator_did_not_allow(
    live: LiveServer, tmp_path: Path
) -> None:
    other = f"{TORCHRUN} --nproc-per-node 1 ..."  # the launcher, with another rank count
    report, err = _agent(live, tmp_path / "work", "--allow", other)
    (outcome,) = report["outcomes"]
    assert outcome["status"] == "refused" and not outcome["prewarm_ran"], outcome
    assert outcome["detail"].startswith("refused: command[0].argv command ")
    assert "argument 2 '2' does not match '1'" in outcome["detail"]
    assert f"agent --allow {ALLOW_BLOCK!r}" in outcome["detail"]
    assert "refused" in err
    row = _rows(live)["block"]
    assert row["status"] == "refused" and row["last_event"]["detail"] == outcome["detail"]
    assert httpx.get(f"{live.url}/v1/snapshots").json()["snapshots"] == []


def test_the_agent_builds_a_command_workload_verified_per_rank(
    live: LiveServer, built: dict[str, Any]
) -> None:
    assert built["status"] == "built", built
    # one fingerprint: the snapshot's (the ranks' one thread each) is the one the agent
    # reported under, so the pair is one warm row, not a warm row and a phantom
    (row,) = [
        r for r in httpx.get(f"{live.url}/v1/status").json()["status"] if r["workload"] == "block"
    ]
    assert row["status"] == "warm" and row["snapshot_id"] == built["snapshot_id"], row
    assert row["fingerprint_digest"] == built["fingerprint_digest"]
    prewarm = built["prewarm"]
    (cold,) = prewarm["commands"]
    assert cold["status"] == "ok" and cold["exit_code"] == 0
    ranks = {p["rank"]: p for p in cold["processes"] if p["compiled"]}
    assert set(ranks) == {0, 1}
    assert all(p["counters"]["fxgraph_cache_miss"] >= 1 for p in ranks.values())
    assert all(p["threads"] == 1 for p in ranks.values())  # torchrun's ranks, not ours
    (warm,) = prewarm["verify"]["commands"]
    assert warm["effective"] and warm["status"] == "ok"
    for proc in (p for p in warm["processes"] if p["compiled"]):
        assert proc["counters"]["fxgraph_cache_miss"] == 0
        assert proc["counters"]["autograd_cache_miss"] == 0
        assert proc["counters"]["fxgraph_cache_hit"] >= 1
    assert prewarm["stats"]["devices"] == ["cpu"]


def test_a_fresh_nodes_torchrun_job_hits_on_every_rank(
    live: LiveServer, built: dict[str, Any], node: tuple[Path, str, dict[int, dict[str, int]]]
) -> None:
    _cache_dir, said, ranks = node
    assert f"restored snapshot {built['snapshot_id'][:12]}" in said, said
    for rank, counters in ranks.items():
        assert counters["threads"] == 1, rank
        assert counters["fxgraph_cache_miss"] == 0 and counters["autograd_cache_miss"] == 0, rank
        assert counters["fxgraph_cache_hit"] >= 1, rank


@pytest.mark.timeout(1500)  # the module's build and node job, then a cold rebuild on 2 ranks
def test_a_harvest_the_workload_does_not_reach_is_kept_back_by_the_agent(
    live: LiveServer,
    built: dict[str, Any],
    node: tuple[Path, str, dict[int, dict[str, int]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cache_dir, _said, _ranks = node
    longer = _job(cache_dir, cache_dir.parent / "report-256", "--seq", "256")
    assert all(c["fxgraph_cache_miss"] >= 1 for c in longer.values())  # not in the workload
    post = _ck("postjob", "--workload", "block", "--server", live.url, "--cache-dir",
               str(cache_dir), "--push", "--json", home=cache_dir.parent)  # fmt: skip
    assert post.returncode == 0, post.stderr
    harvest = json.loads(post.stdout)
    assert harvest["pushed_snapshot_id"] and harvest["pushed_offered"] is False, harvest
    row = _rows(live)["block"]
    assert row["harvested"] == 1 and "kept back" in row["harvest_note"]
    assert "add the jobs' shapes to the workload" in row["harvest_note"]
    before = {s["id"] for s in httpx.get(f"{live.url}/v1/snapshots").json()["snapshots"]}

    work = tmp_path_factory.mktemp("builder-2") / "work"
    report, err = _agent(live, work, "--allow", ALLOW_BLOCK)
    (outcome,) = report["outcomes"]
    assert outcome["status"] == "skipped" and outcome["prewarm_ran"], outcome
    assert outcome["snapshot_id"] == built["snapshot_id"]
    assert "none of the" in outcome["detail"], outcome["detail"]
    assert "compiled by the workload's own run" in outcome["detail"]
    assert "add them to the workload" in outcome["detail"], outcome["detail"]
    assert "its bytes are never loaded" in err, err
    after = {s["id"] for s in httpx.get(f"{live.url}/v1/snapshots").json()["snapshots"]}
    assert after == before  # nothing published: the harvest's bytes were never signed
    assert _rows(live)["block"]["snapshot_id"] == built["snapshot_id"]


def test_a_command_that_crashes_only_cold_is_caught(tmp_path: Path) -> None:
    workload = tmp_path / "crash.toml"
    workload.write_text(_toml("crash", "--crash-when-cold"))
    proc = _ck("prewarm", str(workload), "--cache-dir", str(tmp_path / "c"), "--json",
               home=tmp_path)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "cold_compile_broken"
    (cold,) = report["commands"]
    assert cold["status"] == "error" and cold["exit_code"] != 0
    assert "symbolically trace a dynamo-optimized function" in cold["error"]["message"]
    assert cold["error"]["message"].startswith("exited with status 1; rank ")
    assert not (tmp_path / "c").exists()  # nothing merged


def test_a_usage_error_is_command_failed_with_the_line_that_says_so(tmp_path: Path) -> None:
    """Issue 31: a typo in the command's arguments (``--stepz``) was reported
    cold_compile_broken (exit 3), and torchrun's traceback pushed the rank's argparse line
    out of the 40-line tail. It compiled nothing: ``command_failed``, exit 2, that line kept."""
    workload = tmp_path / "typo.toml"
    workload.write_text(_toml("typo", "--stepz", "2"))
    proc = _ck("prewarm", str(workload), "--cache-dir", str(tmp_path / "c"), "--json",
               home=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "command_failed"
    (cold,) = report["commands"]
    assert cold["status"] == "command_failed" and cold["exit_code"] != 0
    assert "unrecognized arguments: --stepz 2" in cold["error"]["message"]
    assert "before compiling anything" in cold["error"]["message"]
    assert any("unrecognized arguments: --stepz" in line for line in cold["log_tail"])
    assert not (tmp_path / "c").exists()  # nothing merged


def test_a_rank_that_misses_fails_verify_and_is_named(
    node: tuple[Path, str, dict[int, dict[str, int]]], tmp_path: Path
) -> None:
    cache_dir, _said, _ranks = node
    workload = tmp_path / "other.toml"
    workload.write_text(_toml("block", env={"CK_TEST_RANK1_SEQ": "384"}))
    before = sorted(p.relative_to(cache_dir) for p in cache_dir.rglob("*"))
    proc = _ck("verify", str(workload), "--cache-dir", str(cache_dir), home=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NOT effective: command[0] rank 1 (pid " in proc.stdout, proc.stdout
    assert "rank 0 (pid " in proc.stdout and "  hit" in proc.stdout
    # the verify ran in a copy: what rank 1 compiled did not land in the node's dir
    assert sorted(p.relative_to(cache_dir) for p in cache_dir.rglob("*")) == before
