"""Real data for the status page, sent through the JSON API: one pair in each state.

Used by tests/server/test_routes_ui.py and scripts/ui_screenshot.py (docs/status-page.png).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import httpx

from cachekeeper.environment.fingerprint import digest_of
from tests.server.conftest import FINGERPRINT, make_snapshot, push

__all__ = ["ADMIN", "DIGEST", "EXPECTED", "TOKENS", "seed"]

TOKENS = {"read-token-1": "read", "write-token-1": "write", "admin-token-1": "admin"}
ADMIN = {"Authorization": "Bearer admin-token-1"}
DIGEST = digest_of(FINGERPRINT)
TOML = 'name = "{name}"\n[[entrypoint]]\ntarget = "pkg.mod:{step}"\n'
EXPECTED = {
    "resnet": "warm_verified",
    "bert": "warm_unverified",
    "llama": "broken",
    "gpt": "building",
    "t5": "failed",
    "vit": "missing",
    "clip": "stale",
}


def seed(url: str) -> dict[str, str]:
    """Real data through the JSON API; returns {workload: snapshot id}."""
    ids: dict[str, str] = {}
    with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as c:
        for name in EXPECTED:
            r = c.put(f"/v1/workloads/{name}", content=TOML.format(name=name, step="step"))
            assert r.status_code in (200, 201), r.text
        for name, verified, size in (
            ("resnet", True, 3000),
            ("bert", False, 1500),
            ("clip", True, 800),
        ):
            files = {f"fxgraph/{name}/{i}": bytes([i]) * size for i in range(3)}
            manifest, blobs = make_snapshot(files, workload=name, verified=verified)
            # built from the TOML registered now, as a prewarm of it records
            text = TOML.format(name=name, step="step").encode()
            manifest = replace(manifest, workload_digest=hashlib.sha256(text).hexdigest())
            r = push(c, manifest, blobs)
            assert r.status_code == 201, r.text
            ids[name] = r.json()["id"]
        # clip's TOML changes after its snapshot: the snapshot is stale (another digest)
        r = c.put("/v1/workloads/clip", content=TOML.format(name="clip", step="step2"))
        assert r.status_code in (200, 201), r.text
        agent = c.post(
            "/v1/agents",
            json={
                "name": "builder-a",
                "fingerprint": FINGERPRINT,
                "gpus": FINGERPRINT["gpus"],
                "devices": ["cuda:0"],
                "version": "0.1.0",
            },
        ).json()
        for workload, status, extra in (
            (
                "llama",
                "cold_compile_broken",
                {
                    "detail": "ValueError during a cold compile",
                    "traceback_tail": [
                        "Traceback (most recent call last):",
                        '  File "model.py", line 12, in step',
                        "ValueError: shapes (4, 8) and (9, 2) not aligned",
                    ],
                },
            ),
            ("gpt", "building", {}),
            ("bert", "built", {"snapshot_id": ids["bert"]}),  # pushed without a verify
            ("t5", "failed", {"detail": "prewarm timed out after 600 s"}),
        ):
            r = c.post(
                f"/v1/agents/{agent['id']}/events",
                json={
                    "workload": workload,
                    "fingerprint_digest": DIGEST,
                    "status": status,
                    **extra,
                },
            )
            assert r.status_code == 201, r.text
        # what training jobs reported: resnet restored 3 times, started cold once, and one
        # restored job compiled anyway (restore rate 75%, compiled-anyway rate 33%)
        reports = [{"phase": "prejob", "outcome": "restored", "snapshot_id": ids["resnet"]}] * 3
        reports += [
            {"phase": "prejob", "outcome": "cold", "reason_code": "no_matching_snapshot"},
            {
                "phase": "postjob",
                "outcome": "compiled",
                "snapshot_id": ids["resnet"],
                "new_fxgraph": 2,
            },
        ]
        for report in reports:
            body = {"workload": "resnet", "fingerprint_digest": DIGEST, "node": "node-7", **report}
            r = c.post("/v1/reports", json=body)
            assert r.status_code == 201, r.text
    return ids
