"""Resolve ranking and near misses; workload registration with the CLI's parser."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import FINGERPRINT, make_snapshot, push


def _resolve(c: httpx.Client, fingerprint: dict, workload: str, **extra: object) -> dict:
    body = {"fingerprint": fingerprint, "workload": workload, **extra}
    r = c.post("/v1/resolve", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_ranking_verified_exact_newest(client: httpx.Client) -> None:
    older_driver = dict(FINGERPRINT, driver="570.1")
    other_torch = dict(FINGERPRINT, torch="2.12.0+cpu")
    ids = {}
    for name, fp, verified, n in [
        ("unverified-exact", FINGERPRINT, None, 1),
        ("verified-compat", older_driver, True, 2),
        ("verified-exact-old", FINGERPRINT, True, 3),
        ("verified-exact-new", FINGERPRINT, True, 4),
        ("other-torch", other_torch, True, 5),
    ]:
        manifest, blobs = make_snapshot(
            {f"{name}.bin": bytes([n]) * 10}, workload="rank", fingerprint=fp, verified=verified
        )
        assert push(client, manifest, blobs).status_code == 201
        ids[name] = manifest.id

    best = _resolve(client, FINGERPRINT, "rank")
    assert best["snapshot"]["id"] == ids["verified-exact-new"]
    assert best["verified"] and best["exact"]
    # with every exact verified one gone, the driver-compatible verified one beats unverified
    for name in ("verified-exact-new", "verified-exact-old"):
        assert client.delete(f"/v1/snapshots/{ids[name]}").status_code == 204
    best = _resolve(client, FINGERPRINT, "rank")
    assert (
        best["snapshot"]["id"] == ids["verified-compat"] and best["verified"] and not best["exact"]
    )
    # an exact driver policy refuses the older-driver build: the unverified exact one is served
    best = _resolve(client, FINGERPRINT, "rank", driver_policy="exact")
    assert best["snapshot"]["id"] == ids["unverified-exact"] and not best["verified"]

    # a node with a different torch misses, and learns why, field by field
    miss = _resolve(client, dict(FINGERPRINT, torch="2.99.0"), "rank")
    assert miss["snapshot"] is None
    nearest = miss["near_misses"][0]
    assert nearest["snapshot"]["id"] == ids["other-torch"]
    assert nearest["mismatches"] == [
        {"field": "torch", "node": "2.99.0", "snapshot": "2.12.0+cpu", "built_by": None}
    ]
    # a node asking for a GPU index no snapshot covers misses on 'devices'
    miss = _resolve(client, FINGERPRINT, "rank", devices=["cuda:3"])
    assert miss["snapshot"] is None
    assert {m["field"] for m in miss["near_misses"][0]["mismatches"]} == {"devices"}
    assert _resolve(client, FINGERPRINT, "no-such-workload") == {
        "snapshot": None,
        "verified": False,
        "exact": False,
        "near_misses": [],
        "reason": "no workload 'no-such-workload' is registered on this server, and no snapshot"
        " names it",
        "archive_url": None,
        "deltas": [],
        "remote_cache": None,
        "signed_by": None,
    }


WORKLOAD = """
name = "drafter-gqa"
[[attention]]
batch = 1
q_heads = 4
kv_heads = 2
head_dim = 16
seq_lens = [128]
dtype = "float32"
mask = "causal"
"""


def test_workload_routes(client: httpx.Client) -> None:
    r = client.put("/v1/workloads/drafter-gqa", content=WORKLOAD)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["name"] == "drafter-gqa" and len(info["digest"]) == 64
    got = client.get("/v1/workloads/drafter-gqa")
    assert got.text == WORKLOAD and got.headers["content-type"].startswith("application/toml")
    assert client.get("/v1/workloads").json()["workloads"] == [info]

    bad = client.put(
        "/v1/workloads/broken", content='name = "broken"\n[[attention]]\nbatch = "x"\n'
    )
    assert bad.status_code == 422 and bad.json()["error"] == "invalid_workload"
    wrong_name = client.put("/v1/workloads/other", content=WORKLOAD)
    assert wrong_name.status_code == 422 and "drafter-gqa" in wrong_name.json()["detail"]
    not_toml = client.put("/v1/workloads/x", content=b"\xff\xfe")
    assert not_toml.status_code == 422

    assert client.delete("/v1/workloads/drafter-gqa").status_code == 204
    gone = client.get("/v1/workloads/drafter-gqa")
    assert gone.status_code == 404 and gone.json()["error"] == "workload_not_found"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"gpus": "NVIDIA H200"}, "fingerprint field gpus: expected a list, got str"),
        ({"gpus": [{"index": "0", "name": "H200", "capability": "9.0"}]}, "gpus[0].index"),
        ({"cpu": {"threads": "2"}}, "fingerprint field cpu.threads: expected an integer"),
        ({"driver": 580}, "fingerprint field driver: expected a string or null, got int"),
    ],
)
def test_a_malformed_fingerprint_is_refused_naming_the_field(
    client: httpx.Client, change: dict, named: str
) -> None:
    manifest, blobs = make_snapshot({"a.bin": b"bad-fingerprint"}, workload="bad-fp")
    assert push(client, manifest, blobs).status_code in (200, 201)  # one per session
    r = client.post("/v1/resolve", json={"fingerprint": FINGERPRINT | change, "workload": "bad-fp"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_manifest", r.text
    assert named in r.json()["detail"]


def test_a_manifest_with_a_malformed_fingerprint_is_refused_and_resolve_stays_whole(
    client: httpx.Client,
) -> None:
    # Before the typed fingerprint the server stored it, and every resolve of its workload
    # then failed ("'str' object has no attribute 'get'"), whatever node asked.
    bad = dict(FINGERPRINT, gpus="NVIDIA H200")
    manifest, blobs = make_snapshot({"a.bin": b"poisoned"}, workload="poison", fingerprint=bad)
    r = push(client, manifest, blobs)
    assert r.status_code == 422 and r.json()["error"] == "invalid_manifest", r.text
    assert "manifest 'fingerprint' field gpus: expected a list, got str" in r.json()["detail"]
    assert client.get(f"/v1/snapshots/{manifest.id}/manifest").status_code == 404
    good, blobs = make_snapshot({"a.bin": b"healthy"}, workload="poison")
    assert push(client, good, blobs).status_code in (200, 201)
    assert _resolve(client, FINGERPRINT, "poison")["snapshot"]["id"] == good.id
