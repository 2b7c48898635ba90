"""A signing builder signs only what it compiled itself (issue 32, class 1): real compiles.

The attack of the third independent review: a write token published a harvested delta
that added a file to the FX-graph and AOTAutograd key folders of the builder's signed
snapshot; the agent's promotion restored the snapshot with that delta on the builder, its
verify run made torch unpickle the planted file next to the signing key, and the union was
published verified and signed by the builder, so every node that trusted only that key ran
it too. Here the planted file is a pickle whose loading creates a marker file.

One real server (auth on), one builder key, one ``[[command]]`` workload: the test program
``tests/programs/train_block.py`` in one process (no torchrun: the class is about bytes,
not ranks). In order:

1. the agent builds and signs the workload (seq 128);
2. node A restores it with the builder's key trusted, its job runs a longer sequence
   (256) that the workload's command does not, and ``postjob --push`` harvests it;
3. proof that the attack is real: the planted pickle, put into a copy of node A's dir
   where torch will look, is loaded by a job there (its marker appears);
4. the attacker's write token publishes a harvested delta that plants the pickle in the
   snapshot's existing FX-graph and AOTAutograd key folders;
5. the agent's next round, whose launcher configuration (outside the workload file) now
   also runs seq 256, promotes: it compiles the workload itself in a fresh dir, so the
   marker never appears on the builder, and the snapshot it signs holds only its own
   bytes; the harvested seq-256 entries are promoted because its own run compiled them,
   the planted folders are reported;
6. node B, trusting only the builder's key, restores that snapshot and its job hits at
   both sequence lengths.

About four cold compiles; minutes on two loaded cores.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachekeeper.allowlist import Allowlist
from cachekeeper.client.agent import AgentOptions, RoundReport, run_round
from cachekeeper.client.api import CacheClient
from cachekeeper.client.postjob import postjob
from cachekeeper.client.prejob import prejob
from cachekeeper.manifest import FileEntry, Manifest
from cachekeeper.server.settings import Settings
from cachekeeper.signing import generate_keypair, load_public_key, verify_manifest
from tests.hardening.conftest import sha
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.requires import require

pytestmark = [pytest.mark.compile, pytest.mark.timeout(1800)]  # four cold compiles, loaded

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "tests" / "programs" / "train_block.py"
TOKENS = {"builder-tok": "write", "node-tok": "write", "read-tok": "read", "ops-tok": "admin"}
WORKLOAD = (
    'name = "block"\n[[command]]\n'
    f"argv = {json.dumps([sys.executable, str(PROGRAM), '--seq', '128', '--steps', '1'])}\n"
    'timeout = "15m"\n'
)
PLANTED = "!0planted"  # sorts before every entry torch writes: the first one it unpickles


class _Touch:
    """Unpickling this creates ``path``: the stand-in for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def _payload(marker: Path) -> bytes:
    return pickle.dumps(_Touch(marker))


def _key_folders(manifest: Manifest) -> set[str]:
    """The FX-graph (``fxgraph/xx/KEY``) and AOTAutograd (``aotautograd/KEY``) entries."""
    depth = {"fxgraph": 3, "aotautograd": 2}
    out = set()
    for entry in manifest.files:
        parts = entry.path.split("/")
        if parts[0] in depth and len(parts) > depth[parts[0]]:
            out.add("/".join(parts[: depth[parts[0]]]))
    return out


def _job(cache_dir: Path, report: Path, *, check: bool = True, **env: str) -> dict[str, int]:
    """The node's training job (one process) on ``cache_dir``; its own cache counters."""
    run_env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), **env}
    proc = subprocess.run(
        [sys.executable, str(PROGRAM), "--seq", "128", "--steps", "1", "--report", str(report)],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=900,
    )
    if not check:
        return {}
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((report / "rank-0.json").read_text())


def _round(live: LiveServer, work: Path, key: Path) -> RoundReport:
    options = AgentOptions(
        devices=("cpu",),
        work_dir=work,
        name="builder",
        sign_key=key,
        allow=Allowlist.load([f"{sys.executable} ..."]),  # the program, any arguments
    )
    with CacheClient(base_url=live.url, token="builder-tok") as client:
        return run_round(options, client=client)


def _manifest(live: LiveServer, snapshot_id: str) -> Manifest:
    answer = httpx.get(
        f"{live.url}/v1/snapshots/{snapshot_id}", headers={"Authorization": "Bearer read-tok"}
    )
    answer.raise_for_status()
    return Manifest.from_json(answer.content)


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """One thread everywhere (builder, command, nodes): CPU kernels are keyed on it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        patch.delenv("CK_TEST_EXTRA_SEQ", raising=False)
        yield


@pytest.fixture(scope="module")
def live(single_thread: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    require("torch")
    with start_server(Settings(data_dir=tmp_path_factory.mktemp("server"), tokens=TOKENS)) as s:
        httpx.put(
            f"{s.url}/v1/workloads/block",
            content=WORKLOAD,
            headers={"Authorization": "Bearer ops-tok"},
        ).raise_for_status()
        yield s


def test_a_planted_harvest_never_reaches_the_signing_builder(
    live: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reliability
) -> None:
    key, pub, key_id = generate_keypair(tmp_path / "keys" / "builder")
    trusted = [load_public_key(pub)]

    # 1. The builder's own signed snapshot.
    first = _round(live, tmp_path / "work", key)
    (built,) = first.outcomes
    assert built.status == "built", built
    base = _manifest(live, built.snapshot_id or "")
    assert verify_manifest(base, trusted) == key_id and base.verified

    # 2. Node A trusts the builder's key, restores, runs a longer sequence, harvests it.
    node_a = tmp_path / "node-a" / "inductor"
    restored = prejob(
        workload="block", server=live.url, token="read-tok", cache_dir=node_a, trust=[pub]
    )
    assert restored.outcome == "restored" and restored.snapshot_id == base.id, restored
    longer = _job(node_a, tmp_path / "report-a", CK_TEST_EXTRA_SEQ="256")
    assert longer["fxgraph_cache_miss"] >= 1 and longer["fxgraph_cache_hit"] >= 1, longer
    harvest = postjob(
        workload="block", server=live.url, token="node-tok", cache_dir=node_a, push=True
    )
    assert harvest.pushed_snapshot_id and harvest.warning is None, harvest
    honest = _manifest(live, harvest.pushed_snapshot_id)
    harvested_keys = _key_folders(honest)
    assert harvested_keys and not harvested_keys & _key_folders(base)

    # 3. The attack is real: torch unpickles a file planted in an existing key folder.
    proof_dir = tmp_path / "proof" / "inductor"
    shutil.copytree(node_a, proof_dir)
    proof_marker = tmp_path / "proof-ran"
    for folder in _key_folders(base):
        (proof_dir / folder / PLANTED).write_bytes(_payload(proof_marker))
    _job(proof_dir, tmp_path / "report-proof", check=False)  # torch then fails on the object
    assert proof_marker.exists(), "torch did not load the planted pickle: the attack is not real"

    # 4. The attacker's write token plants the pickle in the snapshot's key folders.
    marker = tmp_path / "builder-ran-the-harvest"
    payload = _payload(marker)
    node = {"Authorization": "Bearer node-tok"}
    httpx.put(
        f"{live.url}/v1/blobs/{sha(payload)}", content=payload, headers=node
    ).raise_for_status()
    planted = Manifest(
        files=tuple(
            FileEntry(path=f"{folder}/{PLANTED}", digest=sha(payload), size_bytes=len(payload))
            for folder in sorted(_key_folders(base))
        ),
        fingerprint=base.fingerprint,
        devices=base.devices,
        workload=base.workload,
        workload_digest=base.workload_digest,
        stats={"harvest": {"parent": base.id}},
        source="harvest",
        parent=base.id,
    )
    published = httpx.post(f"{live.url}/v1/snapshots", content=planted.to_json(), headers=node)
    assert published.status_code == 201, published.text

    # 5. The site's launcher now also runs seq 256 (its own config, not the workload file).
    monkeypatch.setenv("CK_TEST_EXTRA_SEQ", "256")
    second = _round(live, tmp_path / "work", key)
    (promoted,) = second.outcomes
    assert not marker.exists(), "the builder unpickled the harvest's planted file"
    assert promoted.status == "built", promoted
    assert "compiled here" in promoted.detail and PLANTED not in promoted.detail, promoted
    assert "already has" in promoted.detail, promoted  # the planted folders are reported
    signed = _manifest(live, promoted.snapshot_id or "")
    assert verify_manifest(signed, trusted) == key_id and signed.verified
    assert signed.source is None and signed.parent is None
    assert not [f.path for f in signed.files if f.path.endswith(PLANTED)]
    assert sha(payload) not in signed.digests
    assert harvested_keys <= _key_folders(signed)  # compiled here, not taken from the node

    # 6. Node B, trusting only the builder's key, gets the builder's snapshot and hits.
    node_b = tmp_path / "node-b" / "inductor"
    fresh = prejob(
        workload="block", server=live.url, token="read-tok", cache_dir=node_b, trust=[pub]
    )
    assert fresh.outcome == "restored" and fresh.snapshot_id == signed.id, fresh
    counters = _job(node_b, tmp_path / "report-b")
    assert counters["fxgraph_cache_miss"] == 0 and counters["fxgraph_cache_hit"] >= 1, counters
    assert not list(node_b.rglob(PLANTED))
    reliability.record(
        "a write token's harvested delta plants a pickle in the signed snapshot's FX-graph and"
        " AOTAutograd key folders; the signing agent promotes (the builder compiles itself,"
        " never loads or signs the harvest; real compiles)",
        tries=1,
        outcome="refused",
        area="trust",
    )
