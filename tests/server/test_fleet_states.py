"""The fleet's state decisions (server/fleet.py over the catalog's facts), through the API.

Each row of ``GET /v1/status`` is decided by the newest fact about its (workload,
fingerprint digest) pair: an agent's report or the publication of a snapshot. These tests
make the facts the way agents, pushes and jobs make them (``POST /v1/agents``, events,
``POST /v1/snapshots``, ``POST /v1/reports``) on the real app in-process
(tests/helpers/in_process.py), so the catalog's queries and the decisions are tested
together in milliseconds. test_fleet.py decides from hand-made facts what needs a clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest
from cachekeeper.server.settings import Settings

from cachekeeper.fingerprint import digest_of
from tests.helpers.in_process import in_process
from tests.server.conftest import FINGERPRINT, make_snapshot, push, workload_toml

DIGEST = digest_of(FINGERPRINT)
_unique = count()


@pytest.fixture
def c(tmp_path: Path) -> Iterator[httpx.Client]:
    with in_process(Settings(data_dir=tmp_path / "data")) as server:
        yield server.client


def register_workload(c: httpx.Client, name: str = "w", *, toml: str | None = None) -> str:
    answer = c.put(f"/v1/workloads/{name}", content=toml or workload_toml(name))
    assert answer.status_code == 200, answer.text
    return str(answer.json()["digest"])


def register_agent(c: httpx.Client, name: str = "builder") -> str:
    body = {"name": name, "fingerprint": FINGERPRINT, "fingerprint_digest": DIGEST}
    answer = c.post("/v1/agents", json=body)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def report(c: httpx.Client, agent: str, status: str, **extra: Any) -> None:
    body = {"workload": "w", "fingerprint_digest": DIGEST, "status": status, **extra}
    answer = c.post(f"/v1/agents/{agent}/events", json=body)
    assert answer.status_code == 201, answer.text


def publish(c: httpx.Client, *, verified: bool | None = True, **manifest: Any) -> str:
    files = {"entry.bin": f"snapshot {next(_unique)}".encode()}
    built, blobs = make_snapshot(files, workload="w", verified=verified)
    built = dataclasses.replace(built, **manifest)
    answer = push(c, built, blobs)
    assert answer.status_code == 201, answer.text
    return built.id


def row(c: httpx.Client, digest: str = DIGEST) -> dict[str, Any]:
    answer = c.get("/v1/status")
    assert answer.status_code == 200, answer.text
    rows = {(r["workload"], r["fingerprint_digest"]): r for r in answer.json()["status"]}
    return rows[("w", digest)]


@pytest.fixture
def agent(c: httpx.Client) -> str:
    register_workload(c)
    return register_agent(c)


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
    c: httpx.Client, agent: str, reported: str, status: str
) -> None:
    assert row(c)["status"] == "missing"  # a registered workload x an agent's environment
    report(c, agent, reported, detail="why")
    found = row(c)
    assert found["status"] == status and found["snapshot_id"] is None
    assert found["last_event"]["status"] == reported and found["agents"] == ["builder"]


@pytest.mark.parametrize("reported", ["built", "skipped"])
def test_a_build_report_naming_a_stored_snapshot_is_warm(
    c: httpx.Client, agent: str, reported: str
) -> None:
    snapshot = publish(c, verified=None)
    report(c, agent, reported, snapshot_id=snapshot)
    found = row(c)
    assert (found["status"], found["snapshot_id"]) == ("warm", snapshot)


def test_the_newest_fact_wins_whichever_kind_it_is(c: httpx.Client, agent: str) -> None:
    report(c, agent, "failed")
    assert row(c)["status"] == "failed"
    snapshot = publish(c)  # a verified publish after the failure: warm again
    assert (row(c)["status"], row(c)["snapshot_id"]) == ("warm", snapshot)
    report(c, agent, "building")  # a rebuild started after it
    assert row(c)["status"] == "building"
    report(c, agent, "cold_compile_broken")
    assert row(c)["status"] == "broken"


def test_a_built_report_whose_snapshot_is_gone_is_missing_unless_another_serves(
    c: httpx.Client, agent: str
) -> None:
    reported = publish(c, verified=None)
    report(c, agent, "built", snapshot_id=reported)
    assert c.delete(f"/v1/snapshots/{reported}").status_code == 204
    assert row(c)["status"] == "missing"
    other = publish(c)
    report(c, agent, "built", snapshot_id=reported)  # the newest fact, naming the gone one
    found = row(c)
    assert (found["status"], found["snapshot_id"]) == ("warm", other)


def test_an_unverified_snapshot_is_warm_until_a_verified_one_comes(
    c: httpx.Client, agent: str
) -> None:
    unverified = publish(c, verified=None)
    assert (row(c)["status"], row(c)["snapshot_id"]) == ("warm", unverified)
    verified = publish(c, verified=True)
    assert row(c)["snapshot_id"] == verified
    newer_unverified = publish(c, verified=None)  # resolve still prefers the verified one
    assert newer_unverified != verified and row(c)["snapshot_id"] == verified


def test_a_warm_row_is_stale_when_its_workload_file_changed(c: httpx.Client) -> None:
    built_from = register_workload(c)
    register_agent(c)
    publish(c, workload_digest=built_from)
    assert row(c)["stale"] is None
    assert register_workload(c) == built_from  # the same file again: still fresh
    assert row(c)["stale"] is None
    changed = register_workload(c, toml=workload_toml("w").replace("[128]", "[256]"))
    found = row(c)
    assert found["status"] == "warm" and found["stale"] is not None
    assert f"built from {built_from[:12]}, registered now: {changed[:12]}" in found["stale"]


def job_report(c: httpx.Client, digest: str, **body: Any) -> None:
    answer = c.post("/v1/reports", json={"workload": "w", "fingerprint_digest": digest, **body})
    assert answer.status_code == 201, answer.text


def test_job_reports_count_on_a_vouched_row_and_add_none_of_their_own(
    c: httpx.Client, agent: str
) -> None:
    snapshot = publish(c)
    job_report(c, DIGEST, phase="prejob", outcome="restored", snapshot_id=snapshot)
    job_report(c, DIGEST, phase="prejob", outcome="cold", reason_code="server_unavailable")
    unknown = "e" * 64  # anyone with a read token may report any digest
    job_report(c, unknown, phase="prejob", outcome="cold", reason_code="no_matching_snapshot")
    rows = c.get("/v1/status").json()["status"]
    assert [(r["workload"], r["fingerprint_digest"]) for r in rows] == [("w", DIGEST)]
    jobs = rows[0]["jobs"]
    assert (jobs["restores"], jobs["cold"]) == (1, 1)
    assert jobs["cold_reasons"] == {"server_unavailable": 1}


def test_a_snapshot_of_an_unregistered_workload_adds_no_row(c: httpx.Client) -> None:
    register_agent(c)
    publish(c)  # workload "w" is not registered
    assert c.get("/v1/status").json()["status"] == []
    register_workload(c)
    assert row(c)["status"] == "warm"
