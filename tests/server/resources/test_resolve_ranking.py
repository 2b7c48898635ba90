"""Resolve ranking (server/resources/resolve.py), one decision per test, on the real app in-process.

The order among snapshots a node can use: verified before unverified, the builder's exact
driver before a compatible one, then the last published. Near misses: the incompatible
snapshots with the fewest mismatching fields, newest first among equals, at most three.
A miss says why. Everything goes through ``POST /v1/resolve`` of ``create_app(settings)``
behind httpx's ASGI transport (tests/helpers/in_process.py): milliseconds a test.
"""

from __future__ import annotations

import json
from itertools import count
from typing import Any

import httpx
import pytest

from tests.server.conftest import FINGERPRINT, make_snapshot, push, workload_toml

_unique = count()


def publish(
    api: httpx.Client,
    *,
    verified: bool | None = True,
    workload: str = "w",
    devices: tuple[str, ...] = ("cuda:0",),
    **fingerprint: Any,
) -> str:
    """A one-file snapshot of ``workload`` built under FINGERPRINT with ``fingerprint``'s
    changes; its id."""
    files = {"entry.bin": f"snapshot {next(_unique)}".encode()}
    manifest, blobs = make_snapshot(
        files,
        workload=workload,
        fingerprint=dict(FINGERPRINT, **fingerprint),
        devices=devices,
        verified=verified,
    )
    answer = push(api, manifest, blobs)
    assert answer.status_code == 201, answer.text
    return manifest.id


def resolve(api: httpx.Client, workload: str = "w", **body: Any) -> dict[str, Any]:
    node = dict(FINGERPRINT, **body.pop("node", {}))
    answer = api.post("/v1/resolve", json={"fingerprint": node, "workload": workload, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def served(api: httpx.Client, workload: str = "w", **body: Any) -> str | None:
    snapshot = resolve(api, workload, **body)["snapshot"]
    return None if snapshot is None else snapshot["id"]


def test_a_verified_snapshot_beats_a_newer_unverified_one(api: httpx.Client) -> None:
    verified = publish(api, verified=True)
    publish(api, verified=None)  # a push of a dir nobody prewarmed, published later
    answer = resolve(api)
    assert answer["snapshot"]["id"] == verified and answer["verified"] is True


def test_an_unverified_snapshot_is_served_when_it_is_all_there_is(api: httpx.Client) -> None:
    unverified = publish(api, verified=None)
    answer = resolve(api)
    assert answer["snapshot"]["id"] == unverified and answer["verified"] is False


def test_the_builders_exact_driver_beats_a_newer_compatible_build(api: httpx.Client) -> None:
    exact = publish(api, driver=FINGERPRINT["driver"])
    compatible = publish(api, driver="570.1")  # older than the node's 580.10: usable
    answer = resolve(api)
    assert answer["snapshot"]["id"] == exact and answer["exact"] is True
    assert api.delete(f"/v1/snapshots/{exact}").status_code == 204
    answer = resolve(api)
    assert answer["snapshot"]["id"] == compatible and answer["exact"] is False


def test_a_verified_compatible_build_beats_an_unverified_exact_one(api: httpx.Client) -> None:
    compatible = publish(api, driver="570.1", verified=True)
    publish(api, verified=None)
    assert served(api) == compatible


def test_among_equals_the_last_published_wins(api: httpx.Client) -> None:
    first = publish(api)
    second = publish(api)
    assert served(api) == second
    assert api.delete(f"/v1/snapshots/{second}").status_code == 204
    assert served(api) == first


def test_republishing_an_identical_manifest_does_not_make_it_newer(api: httpx.Client) -> None:
    manifest, blobs = make_snapshot({"old.bin": b"published first"}, workload="w", verified=True)
    assert push(api, manifest, blobs).status_code == 201
    newer = publish(api)
    again = api.post("/v1/snapshots", content=manifest.to_json())
    assert again.status_code == 200 and again.json()["created"] is False
    assert served(api) == newer


@pytest.mark.parametrize(
    ("policy", "node_driver", "hit"),
    [
        ("newer", "590.1", True),  # a newer node driver runs kernels of an older one
        ("newer", "570.1", False),  # an older one may not (ptxas of a newer toolchain)
        ("exact", "590.1", False),
        ("exact", "580.10", True),
        ("any", "570.1", True),
    ],
)
def test_the_driver_policy_decides_which_drivers_match(
    api: httpx.Client, policy: str, node_driver: str, hit: bool
) -> None:
    built = publish(api)  # under the builder's 580.10
    answer = resolve(api, driver_policy=policy, node={"driver": node_driver})
    if hit:
        assert answer["snapshot"]["id"] == built
        assert answer["exact"] is (node_driver == "580.10")
    else:
        assert answer["snapshot"] is None
        (near,) = answer["near_misses"]
        assert near["mismatches"] == [
            {"field": "driver", "node": node_driver, "snapshot": "580.10", "built_by": None}
        ]


def test_near_misses_are_the_three_with_fewest_mismatches_newest_first(api: httpx.Client) -> None:
    three = publish(api, torch="2.12.0", triton="3.0", python="3.10")
    one_old = publish(api, torch="2.12.0")
    two = publish(api, torch="2.12.0", triton="3.0")
    one_new = publish(api, python="3.12")
    publish(api, workload="other", torch="2.12.0")  # another workload's: never named
    answer = resolve(api, node={"torch": "2.13.0+cpu"})
    assert answer["snapshot"] is None
    near = answer["near_misses"]
    assert [n["snapshot"]["id"] for n in near] == [one_new, one_old, two]
    assert three not in {n["snapshot"]["id"] for n in near}
    assert near[0]["mismatches"] == [
        {"field": "python", "node": "3.11", "snapshot": "3.12", "built_by": None}
    ]
    assert [m["field"] for m in near[2]["mismatches"]] == ["torch", "triton"]


def test_a_node_must_find_every_device_it_uses_covered(api: httpx.Client) -> None:
    gpus = [{"index": i, "name": "NVIDIA H200", "capability": "9.0"} for i in range(2)]
    built = publish(api, devices=("cuda:0",), gpus=gpus)
    assert served(api, node={"gpus": gpus}, devices=["cuda:0"]) == built
    answer = resolve(api, node={"gpus": gpus}, devices=["cuda:0", "cuda:1"])
    assert answer["snapshot"] is None
    (mismatch,) = answer["near_misses"][0]["mismatches"]
    assert mismatch == {
        "field": "devices",
        "node": ["cuda:0", "cuda:1"],
        "snapshot": ["cuda:0"],
        "built_by": None,
    }
    # other GPU models at indices the snapshot does not cover do not matter
    mixed = [gpus[0], {"index": 1, "name": "NVIDIA A100", "capability": "8.0"}]
    assert served(api, node={"gpus": mixed}, devices=["cuda:0"]) == built


def test_a_miss_says_why(api: httpx.Client) -> None:
    assert api.put("/v1/workloads/drafter", content=workload_toml("drafter")).status_code == 200
    assert resolve(api, "drafter")["reason"] == "workload 'drafter' has no snapshot yet"
    assert resolve(api, "drafte")["reason"] == (
        "no workload 'drafte' is registered on this server (did you mean 'drafter'?),"
        " and no snapshot names it"
    )
    publish(api, workload="drafter", torch="2.12.0")
    answer = resolve(api, "drafter")
    assert answer["snapshot"] is None and answer["verified"] is False
    assert answer["reason"] == "no snapshot of workload 'drafter' matches this node"
    # a snapshot is its workload's only: no other workload's snapshot is ever served
    publish(api, workload="unregistered")
    assert served(api, "drafter") is None and served(api, "unregistered") is not None


# -- a node's trust (resolve's trusted_keys, server/trust.py) ---------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The builder's key pair and a key nobody trusts: {name: (key path, TrustedKey)}."""
    from cachekeeper.snapshot.signing import generate_keypair, load_public_key

    root = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("builder", "mallory"):
        key, pub, _ = generate_keypair(root / name)
        out[name] = (key, load_public_key(pub))
    return out


def publish_signed(
    api: httpx.Client, key: Any, *, verified: bool | None = True, **extra: Any
) -> str:
    """Like ``publish``, signed by the key at ``key`` (None: unsigned)."""
    from cachekeeper.snapshot.signing import sign_manifest

    files = {"entry.bin": f"snapshot {next(_unique)}".encode()}
    manifest, blobs = make_snapshot(
        files, workload="w", fingerprint=dict(FINGERPRINT), verified=verified
    )
    if key is not None:
        manifest = sign_manifest(manifest, key)
    answer = push(api, manifest, blobs)
    assert answer.status_code == 201, answer.text
    return manifest.id


def trusting(api: httpx.Client, *trusted: Any, **body: Any) -> dict[str, Any]:
    return resolve(api, trusted_keys=[k.wire for k in trusted], **body)


def test_with_trusted_keys_only_a_signature_the_server_checked_ranks(
    api: httpx.Client, keys: dict[str, Any]
) -> None:
    """An unsigned, an otherwise-signed and a forged snapshot, each newer and "verified",
    do not shadow the builder's signed one for a node that trusts the builder's key."""
    builder_key, builder = keys["builder"]
    genuine = publish_signed(api, builder_key)
    unsigned = publish_signed(api, None)
    mallorys = publish_signed(api, keys["mallory"][0])
    # a write token copies the builder's signature block onto its own manifest
    body = json.loads(api.get(f"/v1/snapshots/{genuine}").text)
    stolen = body["signature"]
    forged, blobs = make_snapshot({"entry.bin": b"the attacker's"}, workload="w", verified=True)
    forged_body = {**forged.to_dict(), "signature": stolen}
    assert push(api, forged, blobs).status_code == 201  # blobs, and an unsigned publish
    assert api.post("/v1/snapshots", content=json.dumps(forged_body)).status_code == 200
    assert served(api) == forged.id  # without trust: the newest verified (as before)

    answer = trusting(api, builder)
    assert answer["snapshot"]["id"] == genuine and answer["verified"] is True
    assert answer["signed_by"] == builder.key_id
    reasons = {n["snapshot"]["id"]: n["mismatches"] for n in answer["near_misses"]}
    assert reasons == {
        forged.id: [
            {
                "field": "signature",
                "node": [builder.key_id],
                "snapshot": f"signature by key {builder.key_id} does not match the manifest"
                " (tampered or corrupted)",
                "built_by": None,
            }
        ],
        mallorys: [
            {
                "field": "signature",
                "node": [builder.key_id],
                "snapshot": f"signed by key {keys['mallory'][1].key_id!r}, which is not trusted",
                "built_by": None,
            }
        ],
        unsigned: [
            {
                "field": "signature",
                "node": [builder.key_id],
                "snapshot": "unsigned",
                "built_by": None,
            }
        ],
    }
    # the node that trusts mallory gets mallory's (the newest its keys vouch for)
    assert trusting(api, keys["mallory"][1])["snapshot"]["id"] == mallorys
    assert trusting(api, builder, keys["mallory"][1])["snapshot"]["id"] == mallorys


def test_a_verified_claim_is_what_the_key_signed(api: httpx.Client, keys: dict[str, Any]) -> None:
    """A write token flips the verified claim of the builder's signed, unverified snapshot
    and keeps the signature: a new id whose signature no longer matches, never ranked."""
    builder_key, builder = keys["builder"]
    honest = publish_signed(api, builder_key, verified=False)
    body = json.loads(api.get(f"/v1/snapshots/{honest}").text)
    body["stats"] = {"verify": {"effective": True}}
    forged = api.post("/v1/snapshots", content=json.dumps(body))
    assert forged.status_code == 201 and forged.json()["verified"] and forged.json()["signed"]
    assert served(api) == forged.json()["id"]  # what the catalog claims: verified, signed
    answer = trusting(api, builder)
    assert answer["snapshot"]["id"] == honest and answer["verified"] is False
    (near,) = answer["near_misses"]
    assert near["snapshot"]["id"] == forged.json()["id"]
    assert "does not match the manifest" in near["mismatches"][0]["snapshot"]


def test_a_trusting_miss_says_no_snapshot_is_signed_by_its_keys(
    api: httpx.Client, keys: dict[str, Any]
) -> None:
    unsigned = publish_signed(api, None)
    answer = trusting(api, keys["builder"][1])
    assert answer["snapshot"] is None and answer["signed_by"] is None
    assert answer["reason"] == (
        "no snapshot of workload 'w' that matches this node is signed by a key it trusts"
        " (those that match are unsigned, signed by another key, or changed after signing)"
    )
    assert answer["near_misses"][0]["snapshot"]["id"] == unsigned
    assert resolve(api, trusted_keys=[])["snapshot"] is None  # an empty list trusts nothing
    assert served(api) == unsigned  # no trust list: signatures are not looked at
    # another environment's snapshot names both: it differs, and the keys do not vouch
    publish(api, torch="2.12.0")
    other = trusting(api, keys["builder"][1], node={"torch": "2.11.0"})
    fields = [[m["field"] for m in n["mismatches"]] for n in other["near_misses"]]
    assert ["torch", "signature"] in fields


def test_a_trusted_key_that_is_not_an_ed25519_key_is_refused(api: httpx.Client) -> None:
    for bad in ("abc", "A" * 43 + "=" + "x", "a key id"):
        answer = api.post(
            "/v1/resolve", json={"fingerprint": FINGERPRINT, "workload": "w", "trusted_keys": [bad]}
        )
        assert answer.status_code == 422 and answer.json()["error"] == "invalid_request", bad


def test_a_trusting_node_is_offered_only_the_deltas_its_keys_signed(
    in_process_server: Any, keys: dict[str, Any]
) -> None:
    from cachekeeper.snapshot.manifest import Manifest
    from cachekeeper.snapshot.signing import sign_manifest

    api = in_process_server(serve_harvested=True).client
    builder_key, builder = keys["builder"]
    base = publish_signed(api, builder_key)
    deltas = []
    for key in (None, builder_key):
        files = {"fxgraph/ab/k/e": f"harvest {next(_unique)}".encode()}
        plain, blobs = make_snapshot(files, workload="w", verified=None)
        delta = Manifest(
            files=plain.files,
            fingerprint=plain.fingerprint,
            devices=plain.devices,
            workload="w",
            stats={"harvest": {"parent": base}},
            source="harvest",
            parent=base,
        )
        if key is not None:
            delta = sign_manifest(delta, key)
        assert push(api, delta, blobs).status_code == 201
        deltas.append(delta.id)
    assert [d["id"] for d in resolve(api)["deltas"]] == deltas
    assert [d["id"] for d in trusting(api, builder)["deltas"]] == [deltas[1]]


def test_a_kept_verdict_does_not_outlive_its_row(api: httpx.Client, keys: dict[str, Any]) -> None:
    """The server keeps its verdicts per row: the same snapshot deleted and published again
    with another signature block is checked again, not served on the old verdict."""
    builder_key, builder = keys["builder"]
    genuine = publish_signed(api, builder_key)
    assert trusting(api, builder)["signed_by"] == builder.key_id  # checked, and kept
    body = json.loads(api.get(f"/v1/snapshots/{genuine}").text)
    assert api.delete(f"/v1/snapshots/{genuine}").status_code == 204
    body["signature"] = {**body["signature"], "signature": "A" * 86 + "=="}
    assert api.post("/v1/snapshots", content=json.dumps(body)).status_code == 201
    answer = trusting(api, builder)
    assert answer["snapshot"] is None, answer
    assert "does not match" in answer["near_misses"][0]["mismatches"][0]["snapshot"]
