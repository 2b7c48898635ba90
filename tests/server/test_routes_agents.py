"""Agents and fleet status routes on a real server: registration, events, status rules."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.pull import resolve_snapshot
from cachekeeper.errors import Forbidden, InvalidManifest, NoMatchingSnapshot
from cachekeeper.fingerprint import digest_of
from tests.server.conftest import FINGERPRINT, make_snapshot, push

TINY_TOML = (
    'name = "{name}"\n[[attention]]\nbatch = 1\nq_heads = 2\nhead_dim = 16\n'
    'seq_lens = [128]\ndtype = "float32"\n'
)
CODE_TOMLS = {  # each holds code an agent would run: registering it needs the admin scope
    "entrypoint": 'name = "code"\n[[entrypoint]]\ntarget = "os:system"\n',
    "command": 'name = "code"\n[[command]]\nargv = ["sh", "-c", "cat /etc/shadow"]\n',
    "mask": TINY_TOML.format(name="code") + 'mask = "os:system"\n',
}
OTHER_FP = dict(FINGERPRINT, triton="9.9.9")


def _register(c: httpx.Client, name: str = "builder-1", fp: dict[str, Any] = FINGERPRINT) -> dict:
    body = {
        "name": name,
        "fingerprint": fp,
        "fingerprint_digest": digest_of(fp),
        "gpus": fp["gpus"],
        "devices": ["cuda:0"],
        "version": "0.1.0",
    }
    r = c.post("/v1/agents", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _event(c: httpx.Client, agent_id: str, workload: str, status: str, **extra: Any) -> dict:
    body = {
        "workload": workload,
        "fingerprint_digest": extra.pop("digest", digest_of(FINGERPRINT)),
        "status": status,
        **extra,
    }
    r = c.post(f"/v1/agents/{agent_id}/events", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def _status(c: httpx.Client, **params: str) -> dict[tuple[str, str], dict]:
    r = c.get("/v1/status", params=params)
    assert r.status_code == 200, r.text
    return {(row["workload"], row["fingerprint_digest"]): row for row in r.json()["status"]}


def test_registration_is_one_agent_per_name_whatever_its_environment(fresh_server) -> None:
    live = fresh_server()
    with httpx.Client(base_url=live.url) as c:
        first = _register(c)
        again = _register(c)
        assert first["created"] and not again["created"]
        assert again["id"] == first["id"] and len(first["id"]) == 16
        assert again["registered_at"] == first["registered_at"]
        assert again["last_seen_at"] > first["last_seen_at"]
        # Issue 31: same host, new Triton: the same agent in a new environment (it used to
        # be a second agent of the same name, and the page listed both)
        upgraded = _register(c, fp=OTHER_FP)
        assert upgraded["id"] == first["id"] and not upgraded["created"]
        assert upgraded["fingerprint_digest"] == digest_of(OTHER_FP)
        assert upgraded["fingerprint"] == OTHER_FP
        assert upgraded["registered_at"] > first["registered_at"]  # its environment's start
        # where the thread count came from is no environment: same digest, same agent
        cpu = {"threads": 1, "isa": "avx2", "aten_cpu_capability": None}
        by_hand = _register(c, fp=dict(OTHER_FP, cpu={**cpu, "threads_from": "OMP_NUM_THREADS=1"}))
        same = _register(
            c, fp=dict(OTHER_FP, cpu={**cpu, "threads_from": "1 cpus this process may use"})
        )
        assert same["fingerprint_digest"] == by_hand["fingerprint_digest"]
        assert same["registered_at"] == by_hand["registered_at"] > upgraded["registered_at"]
        other_host = _register(c, name="builder-2")
        assert other_host["id"] != first["id"]

        beat = c.post(f"/v1/agents/{other_host['id']}/heartbeat")
        assert beat.status_code == 200 and beat.json()["last_seen_at"] > same["last_seen_at"]
        agents = c.get("/v1/agents").json()["agents"]
        assert [a["id"] for a in agents] == [other_host["id"], first["id"]]  # last seen first
        assert agents[1]["gpus"] == FINGERPRINT["gpus"] and agents[1]["version"] == "0.1.0"
        assert agents[1]["devices"] == ["cuda:0"]


def test_bad_registrations_and_unknown_agents_are_refused(fresh_server) -> None:
    live = fresh_server()
    with httpx.Client(base_url=live.url) as c:
        wrong = {"name": "b", "fingerprint": FINGERPRINT, "fingerprint_digest": "0" * 64}
        r = c.post("/v1/agents", json=wrong)
        assert r.status_code == 422 and r.json()["error"] == "invalid_manifest"
        assert "not the digest" in r.json()["detail"]
        r = c.post("/v1/agents", json={"name": "../x", "fingerprint": FINGERPRINT})
        assert r.status_code == 422 and r.json()["error"] == "invalid_request"
        # a malformed fingerprint is refused naming its field, and registers nothing
        bad_fp = dict(FINGERPRINT, gpus=[{"index": 0, "name": "NVIDIA H200"}])
        r = c.post("/v1/agents", json={"name": "b", "fingerprint": bad_fp})
        assert r.status_code == 422 and r.json()["error"] == "invalid_manifest"
        assert r.json()["detail"] == "fingerprint field gpus[0].capability: missing"
        assert c.get("/v1/agents").json()["agents"] == []
        for path in ("/v1/agents/0123456789abcdef/heartbeat", "/v1/agents/0123456789abcdef/events"):
            body = {"workload": "w", "fingerprint_digest": "a" * 64, "status": "built"}
            r = c.post(path, json=body)
            assert r.status_code == 404 and r.json()["error"] == "agent_not_found", r.text
            assert "register it first" in r.json()["detail"]
        agent = _register(c)
        bad = {"workload": "w", "fingerprint_digest": "a" * 64, "status": "exploded"}
        r = c.post(f"/v1/agents/{agent['id']}/events", json=bad)
        assert r.status_code == 422 and "status" in r.json()["detail"]


def test_status_follows_the_newest_fact_per_workload_and_fingerprint(fresh_server) -> None:
    live = fresh_server()
    digest, other = digest_of(FINGERPRINT), digest_of(OTHER_FP)
    with httpx.Client(base_url=live.url) as c:
        for name in ("alpha", "beta"):
            assert c.put(f"/v1/workloads/{name}", content=TINY_TOML.format(name=name)).is_success
        agent = _register(c)
        # registered workloads x registered environments, nothing built yet
        rows = _status(c)
        assert {k: r["status"] for k, r in rows.items()} == {
            ("alpha", digest): "missing",
            ("beta", digest): "missing",
        }
        assert rows[("alpha", digest)]["agents"] == ["builder-1"]

        _event(c, agent["id"], "alpha", "building")
        assert _status(c)[("alpha", digest)]["status"] == "building"
        manifest, blobs = make_snapshot({"a.bin": b"a" * 10}, workload="alpha", verified=True)
        assert push(c, manifest, blobs).status_code == 201
        # the verified snapshot is newer than the 'building' report: warm
        row = _status(c)[("alpha", digest)]
        assert row["status"] == "warm" and row["snapshot_id"] == manifest.id
        _event(c, agent["id"], "alpha", "built", snapshot_id=manifest.id, seconds=12.5)
        row = _status(c)[("alpha", digest)]
        assert row["status"] == "warm" and row["last_event"]["seconds"] == 12.5

        tail = ["Traceback (most recent call last):", "RuntimeError: Detected that you are..."]
        _event(
            c,
            agent["id"],
            "beta",
            "cold_compile_broken",
            detail="RuntimeError",
            traceback_tail=tail,
        )
        row = _status(c)[("beta", digest)]
        assert row["status"] == "broken" and row["last_event"]["traceback_tail"] == tail
        assert row["snapshot_id"] is None

        only = _status(c, workload="beta", fingerprint_digest=digest)
        assert list(only) == [("beta", digest)]

        # the agent's environment changes (issue 31): its rows are the new environment's;
        # the old one keeps the row its snapshot makes, and its broken row goes (the
        # builder builds nothing there any more, so the old report says nothing now)
        upgraded = _register(c, fp=OTHER_FP)
        assert upgraded["id"] == agent["id"]
        _event(c, upgraded["id"], "alpha", "failed", digest=other, detail="Timeout")
        rows = _status(c)
        assert {k: r["status"] for k, r in rows.items()} == {
            ("alpha", other): "failed",
            ("beta", other): "missing",
            ("alpha", digest): "warm",  # untouched by the other env: its snapshot is there
        }
        assert rows[("alpha", digest)]["agents"] == []  # no agent builds that one now
        assert rows[("beta", other)]["agents"] == ["builder-1"]

        # a 'built' report whose snapshot was deleted since is no longer warm
        _event(c, agent["id"], "alpha", "built", snapshot_id=manifest.id, digest=other)
        assert _status(c)[("alpha", other)]["status"] == "warm"
        assert c.delete(f"/v1/snapshots/{manifest.id}").status_code == 204
        assert _status(c)[("alpha", other)]["status"] == "missing"
        assert ("alpha", digest) not in _status(c)  # nothing left of the old environment


def test_client_methods_and_scopes(fresh_server) -> None:
    live = fresh_server(tokens={"w-tok": "write", "r-tok": "read"})
    httpx.put(
        f"{live.url}/v1/workloads/alpha",
        content=TINY_TOML.format(name="alpha"),
        headers={"Authorization": "Bearer w-tok"},
    ).raise_for_status()
    with CacheClient(base_url=live.url, token="w-tok") as client:
        agent = client.register_agent(
            name="builder-1",
            fingerprint=FINGERPRINT,
            fingerprint_digest=digest_of(FINGERPRINT),
            devices=["cpu"],
            gpus=[],
            version="0.1.0",
        )
        assert client.heartbeat(agent.id).id == agent.id
        event = client.report_event(
            agent.id,
            workload="alpha",
            fingerprint_digest=digest_of(FINGERPRINT),
            status="failed",
        )
        assert event.status == "failed" and event.agent_id == agent.id
        assert [w.name for w in client.list_workloads()] == ["alpha"]
        assert client.get_workload("alpha") == TINY_TOML.format(name="alpha")
        assert [a.id for a in client.list_agents()] == [agent.id]
        (row,) = client.fleet_status()
        assert row.status == "failed" and row.workload == "alpha"
        with pytest.raises(InvalidManifest, match="not the digest"):
            client.register_agent(
                name="x", fingerprint=FINGERPRINT, fingerprint_digest="0" * 64, devices=[],
                gpus=[], version="",
            )  # fmt: skip
    with CacheClient(base_url=live.url, token="r-tok") as reader:
        assert [r.status for r in reader.fleet_status()] == ["failed"]
        assert reader.list_agents()[0].fingerprint == json.loads(json.dumps(FINGERPRINT))
        with pytest.raises(Forbidden):
            reader.heartbeat(agent.id)


def test_status_says_which_indices_a_builder_with_fewer_gpus_left_unbuilt(fresh_server) -> None:
    """A 2-GPU builder's snapshot, asked about by 8-GPU training nodes (GPUs are only named
    in the fingerprints here: no GPU is needed to test what the server says)."""
    live = fresh_server()
    gpus = [{"index": i, "name": "NVIDIA H200", "capability": "9.0"} for i in range(8)]
    builder = dict(FINGERPRINT, gpus=gpus[:2])
    with httpx.Client(base_url=live.url) as c:
        assert c.put("/v1/workloads/drafter", content=TINY_TOML.format(name="drafter")).is_success
        _register(c, fp=builder)
        manifest, blobs = make_snapshot(
            {"a.bin": b"a"},
            workload="drafter",
            fingerprint=builder,
            devices=("cuda:0", "cuda:1"),
            verified=True,
        )
        assert push(c, manifest, blobs).status_code == 201
        key = ("drafter", digest_of(builder))
        row = _status(c)[key]
        assert row["status"] == "warm" and row["devices"] == ["cuda:0", "cuda:1"]
        assert row["uncovered"] == [] and row["note"] is None

        row = _status(c, devices="cuda:0-7")[key]
        assert row["uncovered"] == [f"cuda:{i}" for i in range(2, 8)]
        assert row["note"] == (
            "snapshot covers cuda:0,1; a node asks for cuda:0-7: cuda:2-7 never built (the"
            " device index is in Inductor's key): build cuda:2-7 on a builder with >= 8 GPUs"
            " (prewarm --device cuda:2-7), or run one visible GPU per rank (then only cuda:0"
            " is needed)"
        )
        assert _status(c, devices="cuda:0")[key]["note"] is None  # one visible GPU per rank
        bad = c.get("/v1/status", params={"devices": "gpu0"})
        assert bad.status_code == 422 and "gpu0" in bad.json()["detail"]

        # the 8-GPU node itself: no match, and the near miss says the same thing
        node = dict(FINGERPRINT, gpus=gpus)
        answer = c.post("/v1/resolve", json={"fingerprint": node, "workload": "drafter"}).json()
        assert answer["snapshot"] is None
        (mismatch,) = answer["near_misses"][0]["mismatches"]
        assert mismatch["field"] == "devices" and mismatch["snapshot"] == ["cuda:0", "cuda:1"]
        with CacheClient(base_url=live.url) as client:
            with pytest.raises(NoMatchingSnapshot, match=r"cuda:2-7 never built"):
                resolve_snapshot(client, workload="drafter", fingerprint=node)
            hit = resolve_snapshot(client, workload="drafter", fingerprint=node, devices=["cuda:0"])
            assert hit.snapshot_id == manifest.id


@pytest.mark.parametrize("kind", sorted(CODE_TOMLS))
def test_registering_code_needs_the_admin_scope(fresh_server, kind: str) -> None:
    """A write token cannot register a workload that makes agents run code (issue 24's
    attack: an entrypoint of os:system ran as root on a builder); an admin token can."""
    live = fresh_server(tokens={"w-tok": "write", "a-tok": "admin"})
    body = CODE_TOMLS[kind]
    refused = httpx.put(
        f"{live.url}/v1/workloads/code", content=body, headers={"Authorization": "Bearer w-tok"}
    )
    assert refused.status_code == 403, refused.text
    answer = refused.json()
    assert answer["error"] == "forbidden" and "'admin' scope" in answer["detail"]
    assert answer["scope"] == "admin" and answer["granted"] == "write"
    listed = httpx.get(f"{live.url}/v1/workloads", headers={"Authorization": "Bearer w-tok"})
    assert listed.json()["workloads"] == []  # nothing registered
    plain = httpx.put(
        f"{live.url}/v1/workloads/alpha",
        content=TINY_TOML.format(name="alpha"),
        headers={"Authorization": "Bearer w-tok"},
    )
    assert plain.status_code == 200, plain.text  # no code: the write scope is enough
    admitted = httpx.put(
        f"{live.url}/v1/workloads/code", content=body, headers={"Authorization": "Bearer a-tok"}
    )
    assert admitted.status_code == 200, admitted.text
