"""Issue 32, class 6: every table a client writes has a bound and a retention
(``server/budgets.py``). Each reproducer of the attack runs against a real server on
loopback and reads what reached the catalog's real SQLite file; each fails on the code
before the budgets (which stored whatever came, from anyone, forever)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx

from cachekeeper.builder.agent import DEFAULT_BUILD_TIMEOUT_S, AgentOptions, run_round
from cachekeeper.builder.allowlist import Allowlist
from cachekeeper.client.api import CacheClient
from cachekeeper.environment.fingerprint import digest_of
from cachekeeper.server.auth import token_id
from cachekeeper.server.settings import Settings
from tests.helpers.live_server import LiveServer, start_server

TINY = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "cpu-tiny.toml"
TOKENS = {"write-token": "write", "read-token": "read", "node-b": "read", "admin": "admin"}
WRITE = {"Authorization": "Bearer write-token"}
READ = {"Authorization": "Bearer read-token"}
FP: dict[str, Any] = {"schema": 1, "torch": "2.13.0+cpu", "python": "3.11", "gpus": [], "env": {}}


def _db(live: LiveServer) -> sqlite3.Connection:
    return sqlite3.connect(live.settings.data_dir / "meta.sqlite")


def _metric(c: httpx.Client, name: str, **labels: str) -> float:
    text = c.get("/metrics", headers=READ).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _workload_and_agent(c: httpx.Client) -> str:
    """A registered workload ``wl`` and an agent vouching for FP; FP's digest."""
    toml = TINY.read_text().replace('name = "cpu-tiny"', 'name = "wl"')
    assert c.put("/v1/workloads/wl", content=toml, headers=WRITE).status_code == 200
    body = {"name": "builder", "fingerprint": FP, "devices": ["cpu"], "version": "1"}
    assert c.post("/v1/agents", json=body, headers=WRITE).status_code == 200
    return digest_of(FP)


def test_one_read_token_cannot_invent_600_jobs(tmp_path: Path, reliability) -> None:
    """The attack: one read token sent 600 reports, a restore and a 'compiled' postjob for
    each of 300 made-up jobs on made-up nodes, and the status page showed 300 restored
    jobs that compiled anyway. Now the token's 101st new job in the hour is 429, so the
    fleet's numbers move by at most report_jobs_per_token; another node's token still
    reports, and every stored report names the token that sent it."""
    settings = Settings(data_dir=tmp_path / "data", tokens=TOKENS)
    snapshot = "ab" * 32
    with start_server(settings) as live, httpx.Client(base_url=live.url) as c:
        digest = _workload_and_agent(c)
        answers = []
        for i in range(300):
            job = {"workload": "wl", "fingerprint_digest": digest, "node": f"n{i}", "job": f"x:{i}"}
            restored = {**job, "phase": "prejob", "outcome": "restored", "snapshot_id": snapshot}
            compiled = {
                **job,
                "phase": "postjob",
                "outcome": "compiled",
                "snapshot_id": snapshot,
                "new_fxgraph": 3,
            }
            answers.append(c.post("/v1/reports", json=restored, headers=READ))
            answers.append(c.post("/v1/reports", json=compiled, headers=READ))
        honest = {"workload": "wl", "fingerprint_digest": digest, "node": "b1", "job": "slurm:7"}
        other = c.post(
            "/v1/reports",
            json={**honest, "phase": "prejob", "outcome": "restored", "snapshot_id": snapshot},
            headers={"Authorization": "Bearer node-b"},
        )
        row = c.get("/v1/status", headers=READ).json()["status"][0]
        refused = _metric(
            c,
            "cachekeeper_catalog_refusals_total",
            table="job_reports",
            reason="report_jobs_per_token",
        )
    codes = [a.status_code for a in answers]
    budget = settings.report_jobs_per_token
    assert codes[: 2 * budget] == [201] * (2 * budget)  # a job's second report is not new
    assert set(codes[2 * budget :]) == {429}
    said = answers[-1].json()
    assert said["error"] == "rate_limited" and said["budget"] == "report_jobs_per_token"
    assert token_id("read-token") in said["detail"] and "read-token" not in said["detail"]
    assert 0 < said["retry_after_s"] <= settings.reports_window_s
    assert other.status_code == 201, other.text
    jobs = row["jobs"]
    assert jobs["compiled_after_restore"] == budget  # 300 before the budgets
    assert jobs["restores"] == budget + 1 and jobs["reporters"] == 2
    assert refused == 600 - 2 * budget
    with _db(live) as db:
        stored = dict(db.execute("SELECT token_id, COUNT(*) FROM job_reports GROUP BY 1"))
    assert stored == {token_id("read-token"): 2 * budget, token_id("node-b"): 1}
    reliability.record(
        "one read token sends 600 job reports inventing 300 restored jobs that 'compiled"
        " anyway': its new jobs past report_jobs_per_token (100 an hour) are 429 rate_limited,"
        " the status moves by 100, another node's token still counts; each report is stored"
        " with its token_id",
        tries=600,
        outcome="refused",
        area="table budgets",
    )


def test_reports_need_a_token_of_their_own(tmp_path: Path, reliability) -> None:
    """With auth on, anonymous_read opens the read routes but not reports: a report is
    attributed to a token, and the secret itself never reaches the catalog."""
    settings = Settings(data_dir=tmp_path / "data", tokens=TOKENS, anonymous_read=True)
    report = {
        "phase": "prejob",
        "outcome": "cold",
        "workload": "wl",
        "fingerprint_digest": "c" * 64,
    }
    with start_server(settings) as live, httpx.Client(base_url=live.url) as c:
        assert c.get("/v1/status").status_code == 200  # anonymous reads still work
        anonymous = c.post("/v1/reports", json=report)
        unknown = c.post("/v1/reports", json=report, headers={"Authorization": "Bearer nope"})
        signed = c.post("/v1/reports", json=report, headers=READ)
    assert anonymous.status_code == 401, anonymous.text  # 201 before: stored, unattributed
    assert (
        anonymous.json()["error"] == "unauthorized" and "attributed" in anonymous.json()["detail"]
    )
    assert unknown.status_code == 401
    assert signed.status_code == 201, signed.text
    with _db(live) as db:
        rows = db.execute("SELECT token_id FROM job_reports").fetchall()
    assert rows == [(token_id("read-token"),)]
    raw = b"".join(p.read_bytes() for p in (tmp_path / "data").glob("meta.sqlite*"))
    assert b"read-token" not in raw
    reliability.record(
        "job report without a token on an anonymous_read server: 401 (reports are attributed"
        " to the token that sent them; the token itself is never stored)",
        tries=2,
        outcome="refused",
        area="table budgets",
    )


def test_an_anonymous_flood_stays_within_the_reports_table(tmp_path: Path, reliability) -> None:
    """The attack: anonymous reports of ~36 KB each (1,024 devices) filled 63 MB in ~20 s on
    an auth-off server, kept forever. Now the anonymous callers share one budget, the
    table keeps reports_max_bytes (the oldest go first), and the retention empties it."""
    settings = Settings(
        data_dir=tmp_path / "data",
        reports_per_token=10_000,
        report_jobs_per_token=10_000,
        reports_max_bytes=1 << 20,
        reports_retention_s=2.0,
    )
    devices = [f"cuda:{i}".ljust(32, "x") for i in range(1024)]
    sent = 0
    with start_server(settings) as live, httpx.Client(base_url=live.url) as c:
        for i in range(150):
            report = {
                "phase": "prejob",
                "outcome": "cold",
                "workload": "wl",
                "fingerprint_digest": "d" * 64,
                "devices": devices,
                "job": f"flood:{i}",
            }
            body = json.dumps(report).encode()
            sent += len(body)
            answer = c.post(
                "/v1/reports", content=body, headers={"Content-Type": "application/json"}
            )
            assert answer.status_code == 201, answer.text
        pruned = _metric(
            c, "cachekeeper_catalog_pruned_total", table="job_reports", reason="max_bytes"
        )
        with _db(live) as db:
            rows, stored = db.execute(
                "SELECT COUNT(*), SUM(size_bytes) FROM job_reports"
            ).fetchone()
            usage = db.execute(
                "SELECT rows, bytes FROM table_usage WHERE name = 'job_reports'"
            ).fetchone()
            newest = db.execute(
                "SELECT MAX(job) FROM job_reports WHERE job = 'flood:149'"
            ).fetchone()
    assert sent > 5 << 20  # the flood was five times the bound
    assert stored <= 1 << 20 and rows < 150 and (rows, stored) == usage
    assert newest == ("flood:149",)  # what goes is the oldest
    assert pruned == 150 - rows
    time.sleep(2.5)  # past the retention: the next start-up drops them all
    with start_server(settings) as again, _db(again) as db:
        left = db.execute("SELECT COUNT(*) FROM job_reports").fetchone()[0]
    assert left == 0
    reliability.record(
        f"anonymous flood of 150 job reports of 36 KB ({sent >> 20} MiB) on an auth-off server:"
        " the table stays within reports_max_bytes (oldest dropped, counted), and the"
        " retention empties it at the next start",
        tries=150,
        outcome="kept",
        area="table budgets",
    )


def _regime_toml(name: str, count: int) -> str:
    lengths = ", ".join(str(i + 16) for i in range(count))
    return textwrap.dedent(f"""\
        name = "{name}"
        [[attention]]
        batch = 1
        q_heads = 1
        head_dim = 16
        dtype = "float32"
        seq_lens = [{lengths}]
        """)


def test_a_workload_with_100000_sequence_lengths_is_refused(tmp_path: Path, reliability) -> None:
    """The attack: a write token registered a workload with 100,000 sequence lengths (a
    689 KB file, under the 1 MiB cap of then) and the agent compiled it for hours. Now the
    file is over max_workload_bytes (256 KiB); on a server that allows 1 MiB it is refused
    for its field, and so is a small file listing 70 lengths in one regime."""
    huge = _regime_toml("huge", 100_000)
    with start_server(Settings(data_dir=tmp_path / "data", tokens=TOKENS)) as live:
        with httpx.Client(base_url=live.url, headers=WRITE, timeout=60) as c:
            too_big = c.put("/v1/workloads/huge", content=huge)
            seventy = c.put("/v1/workloads/seventy", content=_regime_toml("seventy", 70))
            listed = c.get("/v1/workloads").json()["workloads"]
    lenient = Settings(data_dir=tmp_path / "data2", tokens=TOKENS, max_workload_bytes=1 << 20)
    with (
        start_server(lenient) as live,
        httpx.Client(base_url=live.url, headers=WRITE, timeout=60) as c,  # TOML of 689 KB
    ):
        fields = c.put("/v1/workloads/huge", content=huge)
    assert len(huge.encode()) < 1 << 20
    assert too_big.status_code == 413, too_big.text  # 200 before
    assert seventy.status_code == 422, seventy.text  # 200 before
    assert "attention[0].seq_lens: 70 sequence lengths" in seventy.json()["detail"]
    assert fields.status_code == 422, fields.text  # 200 before
    assert fields.json()["error"] == "invalid_workload"
    assert "attention[0].seq_lens: 100000 sequence lengths" in fields.json()["detail"]
    assert "at most 64 per regime" in fields.json()["detail"]
    assert listed == []
    reliability.record(
        "workload with 100,000 sequence lengths (689 KB) from a write token: 413 past"
        " max_workload_bytes (256 KiB); 422 naming attention[0].seq_lens and its limit (64"
        " per regime) where the server allows 1 MiB, and for 70 lengths in a small file",
        tries=3,
        outcome="refused",
        area="table budgets",
    )


def test_an_endless_build_ends_at_the_agents_default_timeout(
    tmp_path: Path, monkeypatch, reliability
) -> None:
    """A workload that never finishes (here a command that sleeps) ends with a ``timeout``
    outcome, reported, and the agent goes on to the next workload. Without a build
    timeout it held the agent for ever; the default is an hour, so this test shortens it
    (the default itself is what ``agent --help`` shows, checked below)."""
    monkeypatch.setenv("CACHEKEEPER_HOME", str(tmp_path / "home"))
    python = os.path.realpath(sys.executable)  # the allowlist admits real paths
    endless = textwrap.dedent(f"""\
        name = "endless"
        [[command]]
        argv = ["{python}", "-c", "import time; time.sleep(600)"]
        """)
    with start_server(Settings(data_dir=tmp_path / "data", tokens=TOKENS)) as live:
        admin = {"Authorization": "Bearer admin"}
        with httpx.Client(base_url=live.url, headers=admin) as c:
            assert c.put("/v1/workloads/endless", content=endless).status_code == 200
        options = AgentOptions(
            devices=("cpu",),
            work_dir=tmp_path / "work",
            name="builder",
            build_timeout_s=3.0,
            allow=Allowlist.load((f"{python} ...",), ()),  # the program, any arguments
        )
        assert AgentOptions(devices=("cpu",), work_dir=tmp_path).build_timeout_s == 3600.0
        started = time.monotonic()
        with CacheClient(base_url=live.url, token="write-token") as client:
            report = run_round(options, client=client, log=lambda line: None)
            status = client_status(live)
    took = time.monotonic() - started
    (outcome,) = report.outcomes
    assert outcome.status == "failed" and outcome.reported
    assert outcome.detail.startswith("timeout: prewarm of command[0]: no exit after 3 s")
    assert "--build-timeout 3 s" in outcome.detail
    assert took < 60
    assert status["status"] == "failed" and status["last_event"]["detail"] == outcome.detail
    assert DEFAULT_BUILD_TIMEOUT_S == 3600.0
    reliability.record(
        "workload that never finishes (a command sleeping 600 s): the build ends at the"
        " agent's build timeout (default 1 h, here 3 s) with a 'timeout:' outcome, reported",
        tries=1,
        outcome="refused",
        area="table budgets",
    )


def client_status(live: LiveServer) -> dict[str, Any]:
    with httpx.Client(base_url=live.url, headers=READ) as c:
        rows = c.get("/v1/status").json()["status"]
    return next(r for r in rows if r["workload"] == "endless")


def test_agents_and_their_events_are_bounded(tmp_path: Path, reliability) -> None:
    """A write token registered agents with random fingerprints and sent events without end;
    now a new agent past max_agents is 507, a 1 MB ``gpus`` is 413 naming it, and events
    past agent_events_max_rows drop the oldest but never a pair's newest (the status)."""
    settings = Settings(
        data_dir=tmp_path / "data", tokens=TOKENS, max_agents=4, agent_events_max_rows=20
    )
    with start_server(settings) as live, httpx.Client(base_url=live.url, headers=WRITE) as c:
        answers = []
        for i in range(6):
            body = {"name": f"a{i}", "fingerprint": {**FP, "n": i}, "devices": ["cpu"]}
            answers.append(c.post("/v1/agents", json=body))
        again = c.post("/v1/agents", json={"name": "a0", "fingerprint": {**FP, "n": 0}})
        fat = c.post(
            "/v1/agents",
            json={"name": "a1", "fingerprint": {**FP, "n": 1}, "gpus": [{"x": "y" * 1000}] * 1000},
        )
        agent = answers[0].json()["id"]
        for w in ("w1", "w2", "w3"):  # each pair's newest must survive
            event = {"workload": w, "fingerprint_digest": "e" * 64, "status": "failed"}
            assert c.post(f"/v1/agents/{agent}/events", json=event).status_code == 201
        for _ in range(100):
            event = {"workload": "w0", "fingerprint_digest": "e" * 64, "status": "building"}
            assert c.post(f"/v1/agents/{agent}/events", json=event).status_code == 201
        with _db(live) as db:
            kept = db.execute("SELECT workload, COUNT(*) FROM agent_events GROUP BY 1").fetchall()
            agents = db.execute("SELECT COUNT(*) FROM agents").fetchone()[0]
    assert [a.status_code for a in answers] == [200] * 4 + [507] * 2  # 200 six times before
    assert answers[-1].json()["error"] == "insufficient_storage"
    assert "max_agents" in answers[-1].json()["detail"]
    assert again.status_code == 200  # a known agent refreshes
    assert fat.status_code == 413 and "gpus" in fat.json()["detail"], fat.text
    assert agents == 4
    assert dict(kept) == {"w0": 17, "w1": 1, "w2": 1, "w3": 1}  # 20 rows: 103 before
    reliability.record(
        "6 agent registrations (random fingerprints) past max_agents 4, a 1 MB gpus list, and"
        " 103 build events past agent_events_max_rows 20: 507 naming max_agents, 413 naming"
        " gpus, the oldest events dropped and each pair's newest kept",
        tries=109,
        outcome="refused",
        area="table budgets",
    )


def _publish(c: httpx.Client, name: str, **fields: Any) -> httpx.Response:
    data = name.encode() * 40
    digest = hashlib.sha256(data).hexdigest()
    assert c.put(f"/v1/blobs/{digest}", content=data).status_code in (200, 201)
    body = {
        "format": 1,
        "workload": "wl",
        "workload_digest": None,
        "fingerprint": FP,
        "devices": ["cpu"],
        "files": [
            {"path": f"fxgraph/{name}", "digest": digest, "size_bytes": len(data), "mode": 420}
        ],
        "stats": None,
        **fields,
    }
    return c.post("/v1/snapshots", content=json.dumps(body))


def test_workloads_snapshots_and_harvests_are_bounded(tmp_path: Path, reliability) -> None:
    settings = Settings(
        data_dir=tmp_path / "data",
        tokens=TOKENS,
        max_workloads=2,
        max_snapshots=3,
        max_harvested_deltas=1,
    )
    toml = TINY.read_text()
    with start_server(settings) as live, httpx.Client(base_url=live.url, headers=WRITE) as c:
        workloads = [
            c.put(f"/v1/workloads/{n}", content=toml.replace('name = "cpu-tiny"', f'name = "{n}"'))
            for n in ("w1", "w2", "w3")
        ]
        replaced = c.put("/v1/workloads/w1", content=toml.replace('"cpu-tiny"', '"w1"') + "\n")
        parent = _publish(c, "base")
        first = _publish(c, "delta1", source="harvest", parent=parent.json()["id"])
        second = _publish(c, "delta2", source="harvest", parent=parent.json()["id"])
        third = _publish(c, "other")
        fourth = _publish(c, "fourth")
        again = _publish(c, "base")  # the same snapshot again: not a new row
    assert [w.status_code for w in workloads] == [200, 200, 507]
    assert "max_workloads" in workloads[2].json()["detail"]
    assert replaced.status_code == 200
    assert parent.status_code == 201 and first.status_code == 201
    assert second.status_code == 507 and "max_harvested_deltas" in second.json()["detail"]
    assert third.status_code == 201
    assert fourth.status_code == 507 and "max_snapshots" in fourth.json()["detail"]
    assert again.status_code == 200
    reliability.record(
        "a third workload past max_workloads 2, a second harvested delta of one snapshot past"
        " max_harvested_deltas 1, a fourth snapshot past max_snapshots 3: 507 naming the"
        " bound; replacing a workload and re-publishing a snapshot still work",
        tries=3,
        outcome="refused",
        area="table budgets",
    )


def test_a_full_catalog_refuses_client_writes_and_keeps_serving(
    tmp_path: Path, reliability
) -> None:
    """Past max_catalog_bytes, every client write is 507 naming its table; reads go on."""
    settings = Settings(data_dir=tmp_path / "data", tokens=TOKENS, max_catalog_bytes=100_000)
    report = {
        "phase": "prejob",
        "outcome": "cold",
        "workload": "wl",
        "fingerprint_digest": "f" * 64,
    }
    with start_server(settings) as live, httpx.Client(base_url=live.url, headers=WRITE) as c:
        size = live.app.state.services.catalog.catalog_bytes()
        answers = {
            "workloads": c.put("/v1/workloads/cpu-tiny", content=TINY.read_text()),
            "agents": c.post("/v1/agents", json={"name": "a", "fingerprint": FP}),
            "job_reports": c.post("/v1/reports", json=report),
            "snapshots": _publish(c, "full"),
        }
        status = c.get("/v1/status")
        health = c.get("/healthz")
    assert size > settings.max_catalog_bytes
    for table, answer in answers.items():
        assert answer.status_code == 507, (table, answer.text)
        assert answer.json()["table"] == table and "max_catalog_bytes" in answer.json()["detail"]
    assert status.status_code == 200 and health.status_code == 200
    reliability.record(
        "a workload, an agent, a job report and a snapshot into a catalog past"
        " max_catalog_bytes: 507 naming the table, nothing stored; reads and /healthz answer",
        tries=4,
        outcome="refused",
        area="table budgets",
    )
