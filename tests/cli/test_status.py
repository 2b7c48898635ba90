"""``cachekeeper status`` (cli/status.py) against a real server on loopback.

The GPUs exist only in the fingerprints sent (no GPU is needed for what status says)."""

from __future__ import annotations

import json

import httpx

from cachekeeper.environment.fingerprint import digest_of
from tests.cli.conftest import run
from tests.helpers.live_server import LiveServer
from tests.server.conftest import FINGERPRINT, make_snapshot, push

GPUS = [{"index": i, "name": "NVIDIA H200", "capability": "9.0"} for i in range(2)]
BUILDER = dict(FINGERPRINT, gpus=GPUS)  # a 2-GPU builder


def test_status_shows_what_each_snapshot_covers_and_what_8_gpu_nodes_lack(
    open_server: LiveServer,
) -> None:
    with httpx.Client(base_url=open_server.url) as c:
        for name in ("drafter", "gqa"):
            text = f'name = "{name}"\n[[entrypoint]]\ntarget = "pkg.mod:step"\n'
            assert c.put(f"/v1/workloads/{name}", content=text).is_success
        agent = {"name": "builder-2gpu", "fingerprint": BUILDER, "devices": ["cuda:0", "cuda:1"]}
        assert c.post("/v1/agents", json=agent).is_success
        manifest, blobs = make_snapshot(
            {"a.bin": b"a"},
            workload="drafter",
            fingerprint=BUILDER,
            devices=("cuda:0", "cuda:1"),
            verified=True,
        )
        assert push(c, manifest, blobs).status_code == 201

    digest = digest_of(BUILDER)[:12]
    plain = run("status", "--server", open_server.url).splitlines()
    assert plain[0].split() == ["workload", "environment", "status", "covers", "agents"]
    assert plain[1].split() == ["drafter", digest, "warm", "cuda:0,1", "builder-2gpu"]
    assert plain[2].split() == ["gqa", digest, "missing", "-", "builder-2gpu"]
    assert len(plain) == 3  # no --device: nothing to say about coverage

    nodes = run("status", "--server", open_server.url, "--device", "cuda:0-7").splitlines()
    assert nodes[2] == (
        "  ! snapshot covers cuda:0,1; a node asks for cuda:0-7: cuda:2-7 never built (the"
        " device index is in Inductor's key): build cuda:2-7 on a builder with >= 8 GPUs"
        " (prewarm --device cuda:2-7), or run one visible GPU per rank (then only cuda:0 is"
        " needed)"
    )
    assert "!" not in run("status", "--server", open_server.url, "--device", "cuda:0")

    rows = json.loads(run("status", "--server", open_server.url, "--workload", "drafter",
                          "--device", "cuda:0-7", "--json"))["status"]  # fmt: skip
    (row,) = rows
    assert row["devices"] == ["cuda:0", "cuda:1"]
    assert row["uncovered"] == [f"cuda:{i}" for i in range(2, 8)]


def test_status_needs_a_server_and_a_valid_device(open_server: LiveServer) -> None:
    assert "no server" in run("status", code=2)
    assert "is not a GPU index" in run(
        "status", "--server", open_server.url, "--device", "cuda:x", code=2
    )


def test_a_refused_broken_or_failed_row_says_why(open_server: LiveServer) -> None:
    # Issue 31: a refused build showed only "refused" (the reason was in --json or a tooltip)
    why = {
        "refused": "refused: command[0].argv torchrun -m evil is not admitted (allowed: python)",
        "cold_compile_broken": "ValueError: shapes (4, 8) and (9, 2) not aligned\nmore lines",
        "failed": "",
    }
    with httpx.Client(base_url=open_server.url) as c:
        for name in why:
            text = f'name = "{name.replace("_", "-")}"\n[[entrypoint]]\ntarget = "pkg.mod:step"\n'
            assert c.put(f"/v1/workloads/{name.replace('_', '-')}", content=text).is_success
        agent = c.post("/v1/agents", json={"name": "b", "fingerprint": BUILDER}).json()
        for status, detail in why.items():
            event = {"workload": status.replace("_", "-"), "status": status, "detail": detail,
                     "fingerprint_digest": digest_of(BUILDER)}  # fmt: skip
            assert c.post(f"/v1/agents/{agent['id']}/events", json=event).status_code == 201
    lines = run("status", "--server", open_server.url).splitlines()
    assert lines[1].split()[:3] == ["cold-compile-broken", digest_of(BUILDER)[:12], "broken"]
    assert lines[2] == "  ! broken: ValueError: shapes (4, 8) and (9, 2) not aligned"
    assert lines[3].split()[2] == "failed"
    assert lines[4] == "  ! failed: no reason reported (see --json for the traceback)"
    assert lines[5].split()[2] == "refused"
    assert (
        lines[6]
        == "  ! refused: command[0].argv torchrun -m evil is not admitted (allowed: python)"
    )
