"""server/catalog/schema.py's one-time migration of issue 31, on a data dir an older server
left: digests with provenance (``cpu.threads_from``) and one agent per name and digest.

The older server's rows are made the way it made them: a real server publishes, registers
and takes reports over HTTP; then the digests and agent ids it would have stored (the sha256
of the fingerprint's whole JSON; ``sha256(name + "\\n" + digest)[:16]``) are written back
with sqlite3, and the migration's record is dropped, as a catalog from before it has none.
A real server started again on the dir migrates it.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from cachekeeper.fingerprint import digest_of, json_digest
from cachekeeper.server.settings import Settings
from tests.helpers.live_server import start_server
from tests.server.conftest import make_snapshot, push, workload_toml

CPU = {"threads": 1, "isa": "avx2", "aten_cpu_capability": None}
BUILT: dict[str, Any] = {  # what the builder's torchrun ranks compiled under
    "schema": 2,
    "torch": "2.13.0+cpu",
    "triton": None,
    "cuda": None,
    "cuda_wheels": {},
    "driver": None,
    "gpus": [],
    "python": "3.11",
    "arch": "x86_64",
    "env": {},
    "cpu": {**CPU, "threads_from": "OMP_NUM_THREADS=1"},
}
# the same environment, its thread count set another way: the agent's shell, a node
BY_AFFINITY = {**BUILT, "cpu": {**CPU, "threads_from": "1 cpus this process may use"}}
# Recent times: agents unseen for `agents_retention_s` (90 days) are removed at start.
EARLIER = (datetime.now(UTC) - timedelta(days=2)).isoformat(timespec="microseconds")
LATER = (datetime.now(UTC) - timedelta(days=1)).isoformat(timespec="microseconds")


def _old_agent_id(name: str, digest: str) -> str:
    return hashlib.sha256(f"{name}\n{digest}".encode()).hexdigest()[:16]


def _register(c: httpx.Client, fingerprint: dict[str, Any]) -> dict[str, Any]:
    body = {"name": "builder", "fingerprint": fingerprint, "devices": ["cpu"]}
    r = c.post("/v1/agents", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_an_older_servers_digests_and_agents_are_migrated_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    manifest, blobs = make_snapshot(
        {"fxgraph/a/e": b"entry"}, workload="wl", fingerprint=BUILT, devices=("cpu",), verified=True
    )
    with start_server(Settings(data_dir=data)) as live, httpx.Client(base_url=live.url) as c:
        assert c.put("/v1/workloads/wl", content=workload_toml("wl")).is_success
        assert push(c, manifest, blobs).status_code == 201
        agent = _register(c, BUILT)
        assert c.post(
            f"/v1/agents/{agent['id']}/events",
            json={"workload": "wl", "fingerprint_digest": digest_of(BUILT), "status": "built",
                  "snapshot_id": manifest.id},
        ).status_code == 201  # fmt: skip
        for outcome in ("restored", "cold"):
            report = {"phase": "prejob", "outcome": outcome, "workload": "wl", "node": "n1",
                      "fingerprint_digest": digest_of(BY_AFFINITY)}  # fmt: skip
            if outcome == "restored":
                report["snapshot_id"] = manifest.id
            assert c.post("/v1/reports", json=report).status_code == 201

    # What the older server stored: digests of the whole JSON, ids per name and digest,
    # and the same agent once more under the digest its shell had (listed twice).
    old_built, old_shell = json_digest(BUILT), json_digest(BY_AFFINITY)
    assert old_built != old_shell and digest_of(BUILT) == digest_of(BY_AFFINITY)
    db = sqlite3.connect(data / "meta.sqlite")
    with db:
        db.execute("UPDATE snapshots SET fingerprint_digest = ?", [old_built])
        db.execute("UPDATE agent_events SET fingerprint_digest = ?", [old_built])
        db.execute("UPDATE job_reports SET fingerprint_digest = ?", [old_shell])
        first = _old_agent_id("builder", old_built)
        db.execute(
            "UPDATE agents SET id = ?, fingerprint_digest = ?, last_seen_at = ?",
            [first, old_built, EARLIER],
        )
        db.execute("UPDATE agent_events SET agent_id = ?", [first])
        db.execute(
            "INSERT INTO agents SELECT ?, name, ?, ?, devices, registered_at, ?, info FROM agents",
            [_old_agent_id("builder", old_shell), old_shell, json.dumps(BY_AFFINITY), LATER],
        )
        db.execute("DROP TABLE migrations")
        db.execute("PRAGMA user_version = 0")  # a catalog from before schema versions
    assert db.execute("SELECT COUNT(*) FROM agents").fetchone() == (2,)
    db.close()

    with start_server(Settings(data_dir=data)) as live, httpx.Client(base_url=live.url) as c:
        agents = c.get("/v1/agents").json()["agents"]
        assert [(a["id"], a["name"]) for a in agents] == [(agent["id"], "builder")]
        assert agents[0]["last_seen_at"] == LATER  # the one seen last is kept
        assert agents[0]["fingerprint"] == BY_AFFINITY
        (row,) = c.get("/v1/status").json()["status"]
        assert (row["fingerprint_digest"], row["status"]) == (digest_of(BUILT), "warm")
        assert row["agents"] == ["builder"] and row["last_event"]["agent_id"] == agent["id"]
        assert (row["jobs"]["restores"], row["jobs"]["cold"]) == (1, 1)
        # the snapshot resolves as it did, under its unchanged id
        answer = c.post("/v1/resolve", json={"fingerprint": BY_AFFINITY, "workload": "wl"})
        assert answer.json()["snapshot"]["id"] == manifest.id
        assert answer.json()["snapshot"]["fingerprint_digest"] == digest_of(BUILT)
        # an agent of before issue 31 still registers, sending the digest it knows
        older = {"name": "builder", "fingerprint": BUILT, "fingerprint_digest": old_built}
        assert c.post("/v1/agents", json=older).json()["id"] == agent["id"]

    # once: a third start changes nothing (the migration's record is there)
    db = sqlite3.connect(data / "meta.sqlite")
    assert db.execute("SELECT name FROM migrations").fetchall() == [("identity-digests",)]
    db.close()
    with start_server(Settings(data_dir=data)) as live:
        assert len(httpx.get(f"{live.url}/v1/agents").json()["agents"]) == 1
