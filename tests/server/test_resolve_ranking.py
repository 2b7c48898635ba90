"""Resolve ranking (server/resolver.py), one decision per test, on the real app in-process.

The order among snapshots a node can use: verified before unverified, the builder's exact
driver before a compatible one, then the last published. Near misses: the incompatible
snapshots with the fewest mismatching fields, newest first among equals, at most three.
A miss says why. Everything goes through ``POST /v1/resolve`` of ``create_app(settings)``
behind httpx's ASGI transport (tests/helpers/in_process.py): milliseconds a test.
"""

from __future__ import annotations

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
