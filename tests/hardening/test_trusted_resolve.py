"""Signatures and "verified" are facts, not claims (issue 32, class 2): a real server.

The attack of the third independent review: resolve ignored signatures, and "verified" was
a field any write token could set. One unsigned publish that claimed "verified" made every
node with a trust list start cold (resolve named it, the node's restore refused it) while
the builder's signed, verified snapshot was still there, and the signing agent, seeing a
"warm" snapshot, rebuilt nothing. Here a write token (``attacker-tok``) publishes, against
a real server on loopback:

1. an unsigned snapshot claiming "verified", before and after the builder's signed one;
2. the builder's signed, unverified snapshot with its verified claim flipped and the
   builder's signature kept (a forged claim under a copied signature);

and a node (``prejob --trust``, in process: the CLI only passes the paths through) and the
signing agent meet each. Last, a person signing a node's restored dir is refused. Nothing
compiles: the agent's workload holds a command its allowlist does not admit, so "not
warm" shows as ``refused`` instead of ``skipped``.
"""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachekeeper.allowlist import Allowlist
from cachekeeper.children import child_cpu_state
from cachekeeper.client.agent import AgentOptions, run_round
from cachekeeper.client.api import CacheClient
from cachekeeper.client.prejob import prejob
from cachekeeper.errors import SignatureInvalid
from cachekeeper.fingerprint import collect, with_cpu
from cachekeeper.manifest import Manifest
from cachekeeper.server.settings import Settings
from cachekeeper.signing import generate_keypair, load_public_key, verify_manifest
from cachekeeper.snapshot import snapshot_dir
from cachekeeper.store import LocalStore
from tests.hardening.conftest import child_env, cli, visible_files
from tests.helpers.live_server import LiveServer, start_server

TOKENS = {"builder-tok": "write", "attacker-tok": "write", "read-tok": "read", "ops-tok": "admin"}
# A command nothing admits: a round that does not find the workload warm reports 'refused'.
WORKLOAD = 'name = "w"\n[[command]]\nargv = ["/bin/true"]\n'


@pytest.fixture
def live(tmp_path: Path) -> Any:
    with start_server(Settings(data_dir=tmp_path / "data", tokens=TOKENS)) as server:
        httpx.put(
            f"{server.url}/v1/workloads/w",
            content=WORKLOAD,
            headers={"Authorization": "Bearer ops-tok"},
        ).raise_for_status()
        yield server


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    key, pub, _ = generate_keypair(tmp_path / "keys" / "builder")
    return {"key": key, "pub": pub}


def _cache(root: Path, tag: str) -> Path:
    for i in range(3):
        path = root / "fxgraph" / f"a{i}" / f"key{i}" / "entry"
        path.parent.mkdir(parents=True)
        path.write_bytes(f"{tag}: compiled graph {i}\n".encode() * 40)
    return root


def _publish(
    live: LiveServer, cache: Path, *, token: str, verified: bool, sign_key: Path | None = None
) -> Manifest:
    """Snapshot ``cache`` for the agent's and the node's environment and publish it."""
    manifest = snapshot_dir(
        cache,
        store=LocalStore(home=cache.parent / f"store-{cache.name}"),
        workload="w",
        stats={"verify": {"effective": verified}},
        fingerprint=with_cpu(collect(), child_cpu_state(None)),
        sign_key=sign_key,
    )
    return _publish_manifest(live, manifest.to_dict(), cache, token=token)


def _publish_manifest(
    live: LiveServer, body: dict[str, Any], cache: Path, *, token: str
) -> Manifest:
    headers = {"Authorization": f"Bearer {token}"}
    manifest = Manifest.from_dict(body)
    for entry in manifest.files:
        data = (cache / entry.path).read_bytes()
        answer = httpx.put(f"{live.url}/v1/blobs/{entry.digest}", content=data, headers=headers)
        assert answer.status_code in (200, 201), answer.text
    answer = httpx.post(f"{live.url}/v1/snapshots", content=json.dumps(body), headers=headers)
    assert answer.status_code == 201, answer.text
    return manifest


def _agent_round(live: LiveServer, work: Path, key: Path) -> tuple[str, str | None]:
    options = AgentOptions(
        devices=("cpu",), work_dir=work, name="builder", sign_key=key, allow=Allowlist()
    )
    with CacheClient(base_url=live.url, token="builder-tok") as client:
        (outcome,) = run_round(options, client=client).outcomes
    return outcome.status, outcome.snapshot_id


def _wire(key: Any) -> str:
    """A public key as resolve's ``trusted_keys`` carries it (base64 of its 32 bytes)."""
    return base64.b64encode(key.raw).decode()


def _resolve(live: LiveServer, trusted: list[str] | None) -> dict[str, Any]:
    body = {"fingerprint": collect(), "workload": "w", "trusted_keys": trusted}
    answer = httpx.post(
        f"{live.url}/v1/resolve", json=body, headers={"Authorization": "Bearer read-tok"}
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_an_unsigned_publish_shadows_no_signed_snapshot(
    live: LiveServer, keys: dict[str, Path], tmp_path: Path, reliability
) -> None:
    builder = load_public_key(keys["pub"])
    # Only the attacker's unsigned "verified" snapshot: the signing agent does not take it
    # as warm (it would build; its allowlist refuses the command).
    early = _publish(
        live, _cache(tmp_path / "early", "mallory"), token="attacker-tok", verified=True
    )
    assert _resolve(live, None)["snapshot"]["id"] == early.id  # what it claims: verified
    assert _agent_round(live, tmp_path / "work", keys["key"])[0] == "refused"

    genuine_dir = _cache(tmp_path / "genuine", "builder")
    genuine = _publish(live, genuine_dir, token="builder-tok", verified=True, sign_key=keys["key"])
    late = _publish(
        live, _cache(tmp_path / "late", "mallory2"), token="attacker-tok", verified=True
    )
    assert _resolve(live, None)["snapshot"]["id"] == late.id  # no trust list: as before

    answer = _resolve(live, [_wire(builder)])
    assert answer["snapshot"]["id"] == genuine.id and answer["verified"] is True
    assert answer["signed_by"] == builder.key_id
    # the matching snapshot ranked above it (the newer unsigned one) is the near miss
    assert [n["snapshot"]["id"] for n in answer["near_misses"]] == [late.id]
    assert all(
        n["mismatches"]
        == [
            {
                "field": "signature",
                "node": [builder.key_id],
                "snapshot": "unsigned",
                "built_by": None,
            }
        ]
        for n in answer["near_misses"]
    )

    node = tmp_path / "node" / "inductor"
    report = prejob(
        workload="w", server=live.url, token="read-tok", cache_dir=node, trust=[keys["pub"]]
    )
    assert report.outcome == "restored" and report.snapshot_id == genuine.id, report
    assert visible_files(node) == visible_files(genuine_dir)
    assert _agent_round(live, tmp_path / "work", keys["key"]) == ("skipped", genuine.id)
    reliability.record(
        'a write token publishes unsigned "verified" snapshots before and after the builder\'s'
        " signed one: trusting nodes restore the signed one, the signing agent takes only its own"
        " as warm",
        tries=2,
        outcome="refused",
        area="trust",
    )


def test_a_forged_verified_claim_under_a_copied_signature_is_refused(
    live: LiveServer, keys: dict[str, Path], tmp_path: Path, reliability
) -> None:
    builder = load_public_key(keys["pub"])
    cache = _cache(tmp_path / "unverified", "builder")
    honest = _publish(live, cache, token="builder-tok", verified=False, sign_key=keys["key"])
    body = honest.to_dict()
    body["stats"] = {"verify": {"effective": True, "misses": 0}}  # the signature is kept
    forged = _publish_manifest(live, body, cache, token="attacker-tok")
    assert forged.id != honest.id and forged.signature == honest.signature
    with pytest.raises(SignatureInvalid, match="does not match"):
        verify_manifest(forged, [builder])
    stored = httpx.get(
        f"{live.url}/v1/snapshots?workload=w", headers={"Authorization": "Bearer read-tok"}
    ).json()["snapshots"]
    assert {s["id"]: (s["verified"], s["signed"]) for s in stored}[forged.id] == (True, True)

    answer = _resolve(live, [_wire(builder)])
    assert answer["snapshot"]["id"] == honest.id and answer["verified"] is False
    (near,) = answer["near_misses"]
    assert near["snapshot"]["id"] == forged.id
    assert "does not match the manifest" in near["mismatches"][0]["snapshot"]
    # The signing agent does not take the forged claim as warm: it would build.
    assert _agent_round(live, tmp_path / "work", keys["key"])[0] == "refused"
    node = tmp_path / "node" / "inductor"
    report = prejob(
        workload="w", server=live.url, token="read-tok", cache_dir=node, trust=[keys["pub"]]
    )
    assert report.outcome == "restored" and report.snapshot_id == honest.id, report
    reliability.record(
        "a write token flips the verified claim of the builder's signed snapshot and keeps the"
        " signature: resolve (checking it against the node's key) and the signing agent refuse it",
        tries=1,
        outcome="refused",
        area="trust",
    )


def test_a_restored_dir_never_gets_a_builders_signature(
    live: LiveServer, keys: dict[str, Path], tmp_path: Path, reliability
) -> None:
    """A node's dir holds bytes from the server (harvests among them): signing it would
    put the builder's signature on someone else's bytes. `push --sign-key` refuses."""
    attacker = _publish(
        live, _cache(tmp_path / "a", "mallory"), token="attacker-tok", verified=True
    )
    node = tmp_path / "node" / "inductor"
    report = prejob(workload="w", server=live.url, token="read-tok", cache_dir=node)
    assert report.outcome == "restored" and report.snapshot_id == attacker.id, report
    env = child_env(tmp_path / "home")
    pushed = subprocess.run(
        cli("push", str(node), "--workload", "w", "--server", live.url, "--token", "builder-tok",
            "--sign-key", str(keys["key"])),
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert pushed.returncode == 1, pushed.stderr
    assert "refusing to sign" in pushed.stderr and "restored from snapshot" in pushed.stderr
    assert len(pushed.stderr.strip().splitlines()) == 1, pushed.stderr
    stored = httpx.get(
        f"{live.url}/v1/snapshots", headers={"Authorization": "Bearer read-tok"}
    ).json()["snapshots"]
    assert [s["id"] for s in stored] == [attacker.id]  # nothing signed was published
    reliability.record(
        "`push --sign-key` of a node's dir holding restored (write-token) bytes",
        tries=1,
        outcome="refused",
        area="trust",
    )
