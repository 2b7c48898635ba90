"""The fleet's state decisions (server/resources/fleet.py over the catalog's facts), through the API.

Each row of ``GET /v1/status`` is decided by the newest fact about its (workload,
fingerprint digest) pair: an agent's report or the publication of a snapshot. These tests
make the facts the way agents, pushes and jobs make them (``POST /v1/agents``, events,
``POST /v1/snapshots``, ``POST /v1/reports``) on the real app in-process
(tests/helpers/in_process.py), so the catalog's queries and the decisions are tested
together in milliseconds. test_fleet.py decides from hand-made facts what needs a clock.
"""

from __future__ import annotations

import dataclasses
from itertools import count
from typing import Any

import httpx
import pytest

from cachekeeper.environment.fingerprint import digest_of
from tests.server.conftest import FINGERPRINT, make_snapshot, push, workload_toml

DIGEST = digest_of(FINGERPRINT)
_unique = count()


def register_workload(api: httpx.Client, name: str = "w", *, toml: str | None = None) -> str:
    answer = api.put(f"/v1/workloads/{name}", content=toml or workload_toml(name))
    assert answer.status_code == 200, answer.text
    return str(answer.json()["digest"])


def register_agent(api: httpx.Client, name: str = "builder") -> str:
    body = {"name": name, "fingerprint": FINGERPRINT, "fingerprint_digest": DIGEST}
    answer = api.post("/v1/agents", json=body)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def report(api: httpx.Client, agent: str, status: str, **extra: Any) -> None:
    body = {"workload": "w", "fingerprint_digest": DIGEST, "status": status, **extra}
    answer = api.post(f"/v1/agents/{agent}/events", json=body)
    assert answer.status_code == 201, answer.text


def publish(api: httpx.Client, *, verified: bool | None = True, **manifest: Any) -> str:
    files = {"entry.bin": f"snapshot {next(_unique)}".encode()}
    built, blobs = make_snapshot(files, workload="w", verified=verified)
    built = dataclasses.replace(built, **manifest)
    answer = push(api, built, blobs)
    assert answer.status_code == 201, answer.text
    return built.id


def row(api: httpx.Client, digest: str = DIGEST) -> dict[str, Any]:
    answer = api.get("/v1/status")
    assert answer.status_code == 200, answer.text
    rows = {(r["workload"], r["fingerprint_digest"]): r for r in answer.json()["status"]}
    return rows[("w", digest)]


@pytest.fixture
def agent(api: httpx.Client) -> str:
    register_workload(api)
    return register_agent(api)


@pytest.mark.parametrize(
    ("reported", "status"),
    [
        ("building", "building"),
        ("failed", "failed"),
        ("cold_compile_broken", "broken"),
        ("refused", "refused"),
    ],
)
def test_a_report_alone_decides_the_row(
    api: httpx.Client, agent: str, reported: str, status: str
) -> None:
    assert row(api)["status"] == "missing"  # a registered workload x an agent's environment
    report(api, agent, reported, detail="why")
    found = row(api)
    assert found["status"] == status and found["snapshot_id"] is None
    assert found["last_event"]["status"] == reported and found["agents"] == ["builder"]


@pytest.mark.parametrize("reported", ["built", "skipped"])
def test_a_build_report_naming_a_stored_snapshot_is_warm(
    api: httpx.Client, agent: str, reported: str
) -> None:
    snapshot = publish(api, verified=None)
    report(api, agent, reported, snapshot_id=snapshot)
    found = row(api)
    assert (found["status"], found["snapshot_id"]) == ("warm", snapshot)


def test_the_newest_fact_wins_whichever_kind_it_is(api: httpx.Client, agent: str) -> None:
    report(api, agent, "failed")
    assert row(api)["status"] == "failed"
    snapshot = publish(api)  # a verified publish after the failure: warm again
    assert (row(api)["status"], row(api)["snapshot_id"]) == ("warm", snapshot)
    report(api, agent, "building")  # a rebuild started after it
    assert row(api)["status"] == "building"
    report(api, agent, "cold_compile_broken")
    assert row(api)["status"] == "broken"


def test_a_built_report_whose_snapshot_is_gone_is_missing_unless_another_serves(
    api: httpx.Client, agent: str
) -> None:
    reported = publish(api, verified=None)
    report(api, agent, "built", snapshot_id=reported)
    assert api.delete(f"/v1/snapshots/{reported}").status_code == 204
    assert row(api)["status"] == "missing"
    other = publish(api)
    report(api, agent, "built", snapshot_id=reported)  # the newest fact, naming the gone one
    found = row(api)
    assert (found["status"], found["snapshot_id"]) == ("warm", other)


def test_an_unverified_snapshot_is_warm_until_a_verified_one_comes(
    api: httpx.Client, agent: str
) -> None:
    unverified = publish(api, verified=None)
    assert (row(api)["status"], row(api)["snapshot_id"]) == ("warm", unverified)
    verified = publish(api, verified=True)
    assert row(api)["snapshot_id"] == verified
    newer_unverified = publish(api, verified=None)  # resolve still prefers the verified one
    assert newer_unverified != verified and row(api)["snapshot_id"] == verified


def test_a_warm_row_is_stale_when_its_workload_file_changed(api: httpx.Client) -> None:
    built_from = register_workload(api)
    register_agent(api)
    publish(api, workload_digest=built_from)
    assert row(api)["stale"] is None
    assert register_workload(api) == built_from  # the same file again: still fresh
    assert row(api)["stale"] is None
    changed = register_workload(api, toml=workload_toml("w").replace("[128]", "[256]"))
    found = row(api)
    assert found["status"] == "warm" and found["stale"] is not None
    assert f"built from {built_from[:12]}, registered now: {changed[:12]}" in found["stale"]


def job_report(api: httpx.Client, digest: str, **body: Any) -> None:
    answer = api.post("/v1/reports", json={"workload": "w", "fingerprint_digest": digest, **body})
    assert answer.status_code == 201, answer.text


def test_job_reports_count_on_a_vouched_row_and_add_none_of_their_own(
    api: httpx.Client, agent: str
) -> None:
    snapshot = publish(api)
    job_report(api, DIGEST, phase="prejob", outcome="restored", snapshot_id=snapshot)
    job_report(api, DIGEST, phase="prejob", outcome="cold", reason_code="server_unavailable")
    unknown = "e" * 64  # anyone with a read token may report any digest
    job_report(api, unknown, phase="prejob", outcome="cold", reason_code="no_matching_snapshot")
    rows = api.get("/v1/status").json()["status"]
    assert [(r["workload"], r["fingerprint_digest"]) for r in rows] == [("w", DIGEST)]
    jobs = rows[0]["jobs"]
    assert (jobs["restores"], jobs["cold"]) == (1, 1)
    assert jobs["cold_reasons"] == {"server_unavailable": 1}


def test_a_snapshot_of_an_unregistered_workload_adds_no_row(api: httpx.Client) -> None:
    register_agent(api)
    publish(api)  # workload "w" is not registered
    assert api.get("/v1/status").json()["status"] == []
    register_workload(api)
    assert row(api)["status"] == "warm"


def test_a_job_counts_in_the_row_of_the_snapshot_it_restored(api: httpx.Client) -> None:
    # Issue 31: a node whose digest is not the snapshot's (a newer driver, which matching
    # allows; a hook of before issue 31, whose digest held provenance) restored it: the
    # job used to count in no row ("0 restored" beside "restores: 8" in the plot).
    register_workload(api)
    snapshot = publish(api)
    node = digest_of({**FINGERPRINT, "driver": "590.1"})
    for job in ("j1", "j2"):
        job_report(api, node, phase="prejob", outcome="restored", snapshot_id=snapshot, job=job)
    job_report(api, node, phase="postjob", outcome="clean", snapshot_id=snapshot, job="j1")
    job_report(api, node, phase="prejob", outcome="cold", reason_code="no_match", job="j3")
    rows = api.get("/v1/status").json()["status"]
    assert [(r["fingerprint_digest"], r["status"]) for r in rows] == [(DIGEST, "warm")]
    jobs = rows[0]["jobs"]
    assert (jobs["restores"], jobs["postjobs"], jobs["cold"]) == (2, 1, 0)
    # the cold start names no snapshot: it stays under the node's own digest, which no
    # agent or snapshot vouches for, so it adds no row
