"""The post-job hook and job reports: a real restore, the real CLI, a real server.

A job "compiles" here by writing entries where Inductor writes them (the layout is what
``kind_of`` counts); tests/e2e/test_harvest.py proves the count on real CPU compiles.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.postjob import diff_cache, kind_of, postjob, summary_line
from cachekeeper.client.prejob import prejob
from cachekeeper.client.push import push
from cachekeeper.fingerprint import collect
from cachekeeper.server.settings import Settings
from cachekeeper.signing import generate_keypair
from tests.helpers.caches import make_cache
from tests.helpers.live_server import TOKENS, LiveServer, start_server

CK = str(Path(sys.executable).parent / "cachekeeper")


def toml(name: str) -> str:
    return (
        f'name = "{name}"\n[[attention]]\nbatch = 1\nq_heads = 4\nkv_heads = 2\n'
        'head_dim = 16\nseq_lens = [128]\ndtype = "float32"\nmask = "causal"\n'
    )


def ck(*args: str, server: str | None, home: Path, token: str = "read-token"):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCHIND"))}
    env.update(CACHEKEEPER_HOME=str(home), CACHEKEEPER_TOKEN=token)
    if server:
        env["CACHEKEEPER_SERVER"] = server
    return subprocess.run([CK, *args], capture_output=True, text=True, env=env, timeout=120)


def compile_more(cache: Path, tag: str) -> None:
    """What a job that compiled one more graph leaves: FX, AOT, a Triton kernel, code."""
    (cache / "fxgraph" / "zz" / f"key-{tag}").mkdir(parents=True)
    (cache / "fxgraph" / "zz" / f"key-{tag}" / "entry").write_bytes(b"g" * 1000)
    (cache / "aotautograd" / f"aot-{tag}").mkdir(parents=True)
    (cache / "aotautograd" / f"aot-{tag}" / "entry").write_bytes(b"a" * 500)
    kernel = cache / "triton" / "0" / f"hash-{tag}"
    kernel.mkdir(parents=True)
    (kernel / "k.cubin").write_bytes(b"c" * 300)
    (kernel / "k.json").write_bytes(b"{}")
    (cache / "qq").mkdir(exist_ok=True)
    (cache / "qq" / f"code-{tag}.py").write_text("pass\n")


def test_kind_of() -> None:
    assert kind_of("fxgraph/ab/key/entry") == "fxgraph"
    assert kind_of("aotautograd/key/entry") == "aotautograd"
    assert kind_of("triton/0/hash/k.cubin") == "triton"
    assert kind_of("ab/code.py") == "other"
    assert kind_of("fxgraph") == "other"  # a file named like the folder is no entry


@pytest.fixture(scope="module")
def restored(authed_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A snapshot of workload 'wl' pushed for this node, restored by prejob into a dir."""
    base = tmp_path_factory.mktemp("postjob")
    src = base / "src"
    make_cache(src)
    with httpx.Client(
        base_url=authed_server.url, headers={"Authorization": "Bearer write-token"}
    ) as c:
        assert c.put("/v1/workloads/wl", content=toml("wl")).status_code == 200
    with CacheClient(base_url=authed_server.url, token="write-token") as client:
        pushed = push(src, client=client, workload="wl", store=None, fingerprint=collect())
    cache = base / "cache"
    pre = prejob(workload="wl", server=authed_server.url, token="read-token", cache_dir=cache)
    assert pre.outcome == "restored" and pre.reported, pre
    return {"cache": cache, "snapshot_id": pushed.snapshot_id, "home": base / "home"}


def test_postjob_counts_what_the_job_compiled_and_the_server_adds_it_up(
    authed_server: LiveServer, restored: dict
) -> None:
    cache, home = restored["cache"], restored["home"]
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}

    clean = ck(
        "postjob",
        "--workload",
        "wl",
        "--cache-dir",
        str(cache),
        server=authed_server.url,
        home=home,
    )
    assert clean.returncode == 0, clean.stderr
    assert "compiled nothing new on top of snapshot" in clean.stdout

    compile_more(cache, "1")
    proc = ck(
        "postjob", "--workload", "wl", "--cache-dir", str(cache), "--json",
        server=authed_server.url, home=home,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["outcome"] == "compiled" and report["reported"]
    assert report["snapshot_id"] == restored["snapshot_id"]
    assert report["new_entries"] == {"fxgraph": 1, "aotautograd": 1, "triton": 1, "other": 1}
    assert report["new_bytes"] == 1000 + 500 + 300 + 2 + 5
    # Nothing that was there is touched; the next job counts only its own compiles.
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())
    assert diff_cache(cache).new_files == ()

    line = ck(
        "postjob",
        "--workload",
        "wl",
        "--cache-dir",
        str(cache),
        server=authed_server.url,
        home=home,
    )
    assert "compiled nothing new" in line.stdout

    rows = httpx.get(
        f"{authed_server.url}/v1/status",
        params={"workload": "wl"},
        headers={"Authorization": "Bearer read-token"},
    ).json()["status"]
    (row,) = [r for r in rows if r["jobs"]]
    jobs = row["jobs"]
    # three post-job runs after one prejob are one job's (issue 25: a job counts once)
    assert jobs["restores"] == 1 and jobs["postjobs"] == 1
    assert jobs["compiled"] == 1 and jobs["compiled_after_restore"] == 1
    assert jobs["new_graphs"] == 2 and jobs["new_bytes"] == 1807
    assert "does not match training" in row["jobs_note"]
    assert "cachekeeper explain" in row["jobs_note"]

    metrics = httpx.get(
        f"{authed_server.url}/metrics", headers={"Authorization": "Bearer read-token"}
    ).text
    assert 'cachekeeper_job_new_entries_total{kind="fxgraph",workload="wl"} 1' in metrics
    assert re.search(
        r'cachekeeper_job_reports_total\{outcome="compiled",phase="postjob",workload="wl"\} 1',
        metrics,
    )

    status = ck("status", "--workload", "wl", server=authed_server.url, home=home)
    assert status.returncode == 0, status.stderr
    assert "compiled anyway" in status.stdout or "does not match training" in status.stdout


def test_a_kernel_and_a_tuning_alone_after_every_graph_hit_are_benign(
    authed_server: LiveServer, tmp_path: Path
) -> None:
    # Issue 31: a torchtitan job restored through the service hit all 5 FX graphs and both
    # AOTAutograd entries, and postjob told it "the job compiled 0 FX graph(s), 0
    # AOTAutograd entr(ies), 1 Triton kernel(s) ... the workload file does not match
    # training". A job that compiled no graph is never told that.
    src = tmp_path / "src"
    make_cache(src)
    with httpx.Client(
        base_url=authed_server.url, headers={"Authorization": "Bearer write-token"}
    ) as c:
        assert c.put("/v1/workloads/titan", content=toml("titan")).status_code == 200
    with CacheClient(base_url=authed_server.url, token="write-token") as client:
        pushed = push(src, client=client, workload="titan", store=None, fingerprint=collect())
    cache = tmp_path / "cache"
    pre = prejob(workload="titan", server=authed_server.url, token="read-token", cache_dir=cache)
    assert pre.outcome == "restored", pre
    kernel = cache / "triton" / "0" / "hash-rebuilt"  # Triton re-made a binary it lacked
    kernel.mkdir(parents=True)
    (kernel / "k.so").write_bytes(b"k" * 300)
    (cache / "qq").mkdir(exist_ok=True)
    (cache / "qq" / "triton_k.best_config").write_text("{}")  # a tuning result, timed again
    args = ("postjob", "--workload", "titan", "--cache-dir", str(cache))
    line = ck(*args, server=authed_server.url, home=tmp_path / "home")
    assert line.returncode == 0, line.stderr
    assert line.stdout.strip() == (
        f"cachekeeper: postjob: the job compiled no graph on top of snapshot"
        f" {pushed.snapshot_id[:12]}; new: 1 Triton kernel(s), 1 autotune result(s) (0.0 MB),"
        " made again at run time (every FX graph and AOTAutograd entry it used hit): benign,"
        " no sign that the workload file differs from training; nothing to do"
    )
    assert "does not match" not in line.stdout + line.stderr
    rows = httpx.get(
        f"{authed_server.url}/v1/status",
        params={"workload": "titan"},
        headers={"Authorization": "Bearer read-token"},
    ).json()["status"]
    (row,) = [r for r in rows if r["jobs"]]
    assert row["jobs"]["compiled"] == 0 and row["jobs_note"] is None, row
    # what appeared is still counted, for whoever wants to see it
    again = diff_cache(cache)
    assert again.new_files == ()  # recorded: the next job counts only its own


def test_a_cold_start_is_reported_with_its_reason(
    authed_server: LiveServer, tmp_path: Path
) -> None:
    pre = prejob(
        workload="wl-other", server=authed_server.url, token="read-token", cache_dir=tmp_path
    )
    assert pre.cold and pre.reported
    with httpx.Client(
        base_url=authed_server.url, headers={"Authorization": "Bearer write-token"}
    ) as c:
        assert c.put("/v1/workloads/wl-other", content=toml("wl-other")).status_code == 200
        rows = c.get("/v1/status", params={"workload": "wl-other"}).json()["status"]
    (row,) = [r for r in rows if r["jobs"]]
    assert row["jobs"]["cold"] == 1 and row["jobs"]["restores"] == 0
    assert row["jobs"]["cold_reasons"] == {"no_match": 1}
    assert row["jobs_note"] is None


def test_postjob_never_fails_the_job_unless_strict(tmp_path: Path) -> None:
    home = tmp_path / "home"
    missing = tmp_path / "nope"
    proc = ck("postjob", "--workload", "wl", "--cache-dir", str(missing), server=None, home=home)
    assert proc.returncode == 0, proc.stderr
    assert f"cannot read {missing}" in proc.stdout
    assert not missing.exists()

    cache = tmp_path / "cache"
    make_cache(cache)
    down = "http://127.0.0.1:9"  # discard port: nothing listens
    args = ("postjob", "--workload", "wl", "--cache-dir", str(cache), "--timeout", "2")
    proc = ck(*args, server=down, home=home)
    assert proc.returncode == 0
    assert "did not take the report" in proc.stderr
    assert "with no snapshot restored" in proc.stdout
    assert not (cache / ".cachekeeper" / "postjob.json").exists()  # counted again next time
    assert ck(*args, "--strict", server=down, home=home).returncode == 1


def test_postjob_without_a_server_counts_and_remembers(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    make_cache(cache)
    first = postjob(workload="wl", server=None, cache_dir=cache)
    assert first.outcome == "compiled" and first.snapshot_id is None and not first.reported
    assert first.entries == {"fxgraph": 1, "aotautograd": 1, "triton": 0, "other": 2}
    second = postjob(workload="wl", server=None, cache_dir=cache)
    assert second.outcome == "clean" and second.new_files == 0


def test_harvested_deltas_are_layered_only_where_served_and_trusted(tmp_path: Path) -> None:
    """postjob --push publishes a delta that resolve never picks as the snapshot; only a
    --serve-harvested server offers it, and a node with a trust list is not offered an
    unsigned one (the server checks; issue 32) while the signed snapshot under it is still
    restored."""
    key, pub, _ = generate_keypair(tmp_path / "builder")
    fingerprint = collect()
    src = tmp_path / "src"
    make_cache(src)
    for serve_harvested in (False, True):
        data = tmp_path / f"data-{serve_harvested}"
        settings = Settings(data_dir=data, tokens=TOKENS, serve_harvested=serve_harvested)
        with start_server(settings) as live:
            with CacheClient(base_url=live.url, token="write-token") as client:
                base = push(
                    src, client=client, workload="wl", fingerprint=fingerprint, sign_key=key
                )
            node_a = tmp_path / f"a-{serve_harvested}"
            assert (
                prejob(workload="wl", server=live.url, token="read-token", cache_dir=node_a).outcome
                == "restored"
            )
            compile_more(node_a, "h")
            done = postjob(
                workload="wl", server=live.url, token="write-token", cache_dir=node_a, push=True
            )
            assert done.pushed_snapshot_id is not None, done
            assert done.pushed_offered is serve_harvested  # the publish said so
            line = summary_line(done)
            assert "harvested as snapshot" in line
            # the line says plainly when no node will get it (issue 23)
            assert ("kept back" in line) is not serve_harvested, line

            node_b = tmp_path / f"b-{serve_harvested}"
            got = prejob(workload="wl", server=live.url, token="read-token", cache_dir=node_b)
            assert got.outcome == "restored" and got.snapshot_id == base.snapshot_id
            harvested = (node_b / "fxgraph" / "zz" / "key-h" / "entry").exists()
            assert harvested is serve_harvested
            assert got.deltas == ((done.pushed_snapshot_id,) if serve_harvested else ())

            # A trust list covers the delta too: unsigned, it is not even offered.
            node_c = tmp_path / f"c-{serve_harvested}"
            trusted = prejob(
                workload="wl", server=live.url, token="read-token", cache_dir=node_c, trust=[pub]
            )
            assert trusted.outcome == "restored", trusted
            assert not (node_c / "fxgraph" / "zz" / "key-h").exists()
            assert trusted.deltas == () and trusted.delta_problems == ()


def test_a_report_with_an_impossible_count_is_refused(authed_server: LiveServer) -> None:
    body = {
        "phase": "postjob",
        "outcome": "clean",
        "workload": "wl",
        "fingerprint_digest": "a" * 64,
    }
    with httpx.Client(
        base_url=authed_server.url, headers={"Authorization": "Bearer read-token"}
    ) as c:
        too_big = c.post("/v1/reports", json={**body, "new_bytes": 10**30})
        assert too_big.status_code == 422 and "new_bytes" in too_big.json()["detail"]
        assert c.post("/v1/reports", json={**body, "new_bytes": 2**48}).status_code == 201


def test_a_harvested_delta_carries_its_parents_fingerprint(tmp_path: Path) -> None:
    """One fingerprint per snapshot (issue 25): a node may match a snapshot and still differ
    from its builder (a newer driver, the 'newer' policy); what it harvests is layered on
    that snapshot and offered only with it, so it carries the parent's fingerprint. Under
    the node's own it was never served (resolve offers deltas of the parent's digest)."""
    built = {**collect(), "driver": "580.10"}
    node = {**built, "driver": "590.1"}  # newer than the builder's: it matches
    src = tmp_path / "src"
    make_cache(src)
    settings = Settings(data_dir=tmp_path / "data", tokens=TOKENS, serve_harvested=True)
    with start_server(settings) as live:
        with CacheClient(base_url=live.url, token="write-token") as client:
            base = push(src, client=client, workload="wl", fingerprint=built)
        node_a = tmp_path / "a"
        pre = prejob(
            workload="wl", server=live.url, token="read-token", cache_dir=node_a, fingerprint=node
        )
        assert pre.outcome == "restored", pre
        compile_more(node_a, "d")
        done = postjob(
            workload="wl",
            server=live.url,
            token="write-token",
            cache_dir=node_a,
            fingerprint=node,
            push=True,
        )
        assert done.pushed_snapshot_id is not None, done
        with CacheClient(base_url=live.url, token="read-token") as client:
            delta = client.get_manifest(done.pushed_snapshot_id)
            parent = client.get_manifest(base.snapshot_id)
            assert delta.fingerprint == parent.fingerprint and delta.parent == parent.id
            offered = client.resolve(node, workload="wl")
        assert [d.id for d in offered.deltas] == [done.pushed_snapshot_id]


def test_a_job_is_counted_once_whatever_its_ranks_and_reruns_report(tmp_path: Path) -> None:
    """Issue 25: a prolog run per rank counted every rank as a job, and postjob run twice
    on one dir counted two; each report now names its job (client/job_reports.job_id)."""
    src = tmp_path / "src"
    make_cache(src)
    settings = Settings(data_dir=tmp_path / "data", tokens=TOKENS)
    with start_server(settings) as live:
        with CacheClient(base_url=live.url, token="write-token") as client:
            client.register_workload("wl", toml("wl"))
            push(src, client=client, workload="wl", fingerprint=collect())
        cache = tmp_path / "node"

        def jobs():
            with CacheClient(base_url=live.url, token="read-token") as client:
                (row,) = client.fleet_status(workload="wl")
            return row.jobs

        for _rank in range(3):  # one job, three ranks: one restores, two find it done
            pre = prejob(workload="wl", server=live.url, token="read-token", cache_dir=cache,
                         environ={})  # fmt: skip
            assert pre.reported, pre
        for _again in range(2):  # the epilog, and someone running it again by hand
            assert postjob(workload="wl", server=live.url, token="read-token", cache_dir=cache,
                           environ={}).reported  # fmt: skip
        first = jobs()
        assert (first.restores, first.postjobs, first.cold) == (1, 1, 0), first

        # the next job on this node, after the window: a new job
        stamp = cache / ".cachekeeper" / "job.json"
        body = json.loads(stamp.read_text())
        stamp.write_text(json.dumps({**body, "at": body["at"] - 3600}))
        prejob(workload="wl", server=live.url, token="read-token", cache_dir=cache, environ={})
        postjob(workload="wl", server=live.url, token="read-token", cache_dir=cache, environ={})
        second = jobs()
        assert (second.restores, second.postjobs) == (2, 2), second

        # under SLURM the job id says it, across cache dirs and steps
        for rank in range(2):
            prejob(workload="wl", server=live.url, token="read-token",
                   cache_dir=tmp_path / f"rank-{rank}", environ={"SLURM_JOB_ID": "4242"})  # fmt: skip
        assert jobs().restores == 3
        # a report without a job (an older client) is a job of its own
        body = {"phase": "prejob", "outcome": "restored", "workload": "wl",
                "fingerprint_digest": second.fingerprint_digest}  # fmt: skip
        headers = {"Authorization": "Bearer read-token"}
        for _ in range(2):
            assert httpx.post(f"{live.url}/v1/reports", json=body, headers=headers).is_success
        assert jobs().restores == 5
