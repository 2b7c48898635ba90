"""Resolve ranking (server/resolver.py), one decision per test, on the real app in-process.

The order among snapshots a node can use: verified before unverified, the builder's exact
driver before a compatible one, then the last published. Near misses: the incompatible
snapshots with the fewest mismatching fields, newest first among equals, at most three.
A miss says why. Everything goes through ``POST /v1/resolve`` of ``create_app(settings)``
behind httpx's ASGI transport (tests/helpers/in_process.py): milliseconds a test.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest
from cachekeeper.server.settings import Settings

from tests.helpers.in_process import in_process
from tests.server.conftest import FINGERPRINT, make_snapshot, push, workload_toml

_unique = count()


@pytest.fixture
def c(tmp_path: Path) -> Iterator[httpx.Client]:
    with in_process(Settings(data_dir=tmp_path / "data")) as server:
        yield server.client


def publish(
    c: httpx.Client,
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
    answer = push(c, manifest, blobs)
    assert answer.status_code == 201, answer.text
    return manifest.id


def resolve(c: httpx.Client, workload: str = "w", **body: Any) -> dict[str, Any]:
    node = dict(FINGERPRINT, **body.pop("node", {}))
    answer = c.post("/v1/resolve", json={"fingerprint": node, "workload": workload, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def served(c: httpx.Client, workload: str = "w", **body: Any) -> str | None:
    snapshot = resolve(c, workload, **body)["snapshot"]
    return None if snapshot is None else snapshot["id"]


def test_a_verified_snapshot_beats_a_newer_unverified_one(c: httpx.Client) -> None:
    verified = publish(c, verified=True)
    publish(c, verified=None)  # a push of a dir nobody prewarmed, published later
    answer = resolve(c)
    assert answer["snapshot"]["id"] == verified and answer["verified"] is True


def test_an_unverified_snapshot_is_served_when_it_is_all_there_is(c: httpx.Client) -> None:
    unverified = publish(c, verified=None)
    answer = resolve(c)
    assert answer["snapshot"]["id"] == unverified and answer["verified"] is False


def test_the_builders_exact_driver_beats_a_newer_compatible_build(c: httpx.Client) -> None:
    exact = publish(c, driver=FINGERPRINT["driver"])
    compatible = publish(c, driver="570.1")  # older than the node's 580.10: usable
    answer = resolve(c)
    assert answer["snapshot"]["id"] == exact and answer["exact"] is True
    assert c.delete(f"/v1/snapshots/{exact}").status_code == 204
    answer = resolve(c)
    assert answer["snapshot"]["id"] == compatible and answer["exact"] is False


def test_a_verified_compatible_build_beats_an_unverified_exact_one(c: httpx.Client) -> None:
    compatible = publish(c, driver="570.1", verified=True)
    publish(c, verified=None)
    assert served(c) == compatible


def test_among_equals_the_last_published_wins(c: httpx.Client) -> None:
    first = publish(c)
    second = publish(c)
    assert served(c) == second
    assert c.delete(f"/v1/snapshots/{second}").status_code == 204
    assert served(c) == first


def test_republishing_an_identical_manifest_does_not_make_it_newer(c: httpx.Client) -> None:
    manifest, blobs = make_snapshot({"old.bin": b"published first"}, workload="w", verified=True)
    assert push(c, manifest, blobs).status_code == 201
    newer = publish(c)
    again = c.post("/v1/snapshots", content=manifest.to_json())
    assert again.status_code == 200 and again.json()["created"] is False
    assert served(c) == newer


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
    c: httpx.Client, policy: str, node_driver: str, hit: bool
) -> None:
    built = publish(c)  # under the builder's 580.10
    answer = resolve(c, driver_policy=policy, node={"driver": node_driver})
    if hit:
        assert answer["snapshot"]["id"] == built
        assert answer["exact"] is (node_driver == "580.10")
    else:
        assert answer["snapshot"] is None
        (near,) = answer["near_misses"]
        assert near["mismatches"] == [
            {"field": "driver", "node": node_driver, "snapshot": "580.10"}
        ]


def test_near_misses_are_the_three_with_fewest_mismatches_newest_first(c: httpx.Client) -> None:
    three = publish(c, torch="2.12.0", triton="3.0", python="3.10")
    one_old = publish(c, torch="2.12.0")
    two = publish(c, torch="2.12.0", triton="3.0")
    one_new = publish(c, python="3.12")
    publish(c, workload="other", torch="2.12.0")  # another workload's: never named
    answer = resolve(c, node={"torch": "2.13.0+cpu"})
    assert answer["snapshot"] is None
    near = answer["near_misses"]
    assert [n["snapshot"]["id"] for n in near] == [one_new, one_old, two]
    assert three not in {n["snapshot"]["id"] for n in near}
    assert near[0]["mismatches"] == [{"field": "python", "node": "3.11", "snapshot": "3.12"}]
    assert [m["field"] for m in near[2]["mismatches"]] == ["torch", "triton"]


def test_a_node_must_find_every_device_it_uses_covered(c: httpx.Client) -> None:
    gpus = [{"index": i, "name": "NVIDIA H200", "capability": "9.0"} for i in range(2)]
    built = publish(c, devices=("cuda:0",), gpus=gpus)
    assert served(c, node={"gpus": gpus}, devices=["cuda:0"]) == built
    answer = resolve(c, node={"gpus": gpus}, devices=["cuda:0", "cuda:1"])
    assert answer["snapshot"] is None
    (mismatch,) = answer["near_misses"][0]["mismatches"]
    assert mismatch == {"field": "devices", "node": ["cuda:0", "cuda:1"], "snapshot": ["cuda:0"]}
    # other GPU models at indices the snapshot does not cover do not matter
    mixed = [gpus[0], {"index": 1, "name": "NVIDIA A100", "capability": "8.0"}]
    assert served(c, node={"gpus": mixed}, devices=["cuda:0"]) == built


def test_a_miss_says_why(c: httpx.Client) -> None:
    assert c.put("/v1/workloads/drafter", content=workload_toml("drafter")).status_code == 200
    assert resolve(c, "drafter")["reason"] == "workload 'drafter' has no snapshot yet"
    assert resolve(c, "drafte")["reason"] == (
        "no workload 'drafte' is registered on this server (did you mean 'drafter'?),"
        " and no snapshot names it"
    )
    publish(c, workload="drafter", torch="2.12.0")
    answer = resolve(c, "drafter")
    assert answer["snapshot"] is None and answer["verified"] is False
    assert answer["reason"] == "no snapshot of workload 'drafter' matches this node"
    # a snapshot is its workload's only: no other workload's snapshot is ever served
    publish(c, workload="unregistered")
    assert served(c, "drafter") is None and served(c, "unregistered") is not None
