"""Decisions re-checked under the write lock (issue 18.2): a GC plan is computed outside
the lock and may be stale by the time it runs.

The race is injected, not hoped for: each test wraps this server's ``Collector.plan``
so that, after the GC route planned and before it executes, a real HTTP request (served
by another worker thread of the same live server) changes what the plan decided on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import httpx

from cachekeeper.backends.local import LocalBackend
from tests.helpers.live_server import LiveServer
from tests.server.conftest import make_snapshot, push, random_files


def _between_plan_and_execute(live: LiveServer, act: Callable[[Any], None]) -> None:
    """Run ``act(plan)`` after the next GC's plan and before its execution."""
    services = live.app.state.services
    real_plan = services.gc.plan

    def plan_then_act(**options: Any) -> Any:
        plan = real_plan(**options)
        act(plan)
        return plan

    services.gc.plan = plan_then_act


def test_a_snapshot_pinned_after_the_plan_is_not_evicted(fresh_server) -> None:  # type: ignore[no-untyped-def]
    live = fresh_server()
    manifest, blobs = make_snapshot(random_files(3, size=20_000, seed=1), workload="pinme")
    with httpx.Client(base_url=live.url, timeout=30) as c:
        assert push(c, manifest, blobs).status_code == 201
        live.settings.max_store_bytes = 1  # the operator lowers the cap: evict all unpinned

        def pin(plan: Any) -> None:
            assert plan.snapshots_evicted == (manifest.id,)  # planned before the pin
            answer = httpx.post(f"{live.url}/v1/snapshots/{manifest.id}/pin", timeout=30)
            assert answer.json()["pinned"] is True

        _between_plan_and_execute(live, pin)
        gc = c.post("/v1/gc", json={"dry_run": False}).json()
        assert gc["snapshots_evicted"] == []
        assert c.get(f"/v1/snapshots/{manifest.id}").status_code == 200
        archive = c.get(f"/v1/snapshots/{manifest.id}/archive")
        assert archive.status_code == 200 and len(archive.content) > 0
        assert c.post("/v1/blobs/missing", json={"digests": sorted(blobs)}).json()["missing"] == []


def test_an_orphan_uploaded_after_the_plan_keeps_its_file(fresh_server) -> None:  # type: ignore[no-untyped-def]
    """The orphan is a blob file with no row, as a crash between the file and its row
    leaves it; with a grace period of 0 the plan lists it. Then a push uploads the same
    blob (the server finds the file already there and records its row) and publishes."""
    live = fresh_server(gc_grace_s=0)
    content = b"a blob a push needs, already on disk without a row"
    digest = hashlib.sha256(content).hexdigest()
    LocalBackend(live.settings.data_dir / "blobs").put([content], digest=digest)
    manifest, blobs = make_snapshot({"kept.bin": content}, workload="orphan")
    with httpx.Client(base_url=live.url, timeout=30) as c:

        def push_it(plan: Any) -> None:
            assert digest in plan.orphan_files
            with httpx.Client(base_url=live.url, timeout=30) as other:
                assert push(other, manifest, blobs).status_code == 201

        _between_plan_and_execute(live, push_it)
        c.post("/v1/gc", json={"dry_run": False}).raise_for_status()
        assert c.post("/v1/blobs/missing", json={"digests": [digest]}).json()["missing"] == []
        assert c.get(f"/v1/blobs/{digest}").content == content
        assert c.get(f"/v1/snapshots/{manifest.id}/archive").status_code == 200


def test_a_blob_row_without_its_file_is_reported_missing(fresh_server) -> None:  # type: ignore[no-untyped-def]
    """What the race above left before the fix (a row whose file is gone) is made here by
    deleting the file behind the server's back: ``blobs/missing`` must say so, so that a
    push uploads it again instead of publishing a snapshot nobody can pull."""
    live = fresh_server()
    content = b"this file will vanish"
    digest = hashlib.sha256(content).hexdigest()
    with httpx.Client(base_url=live.url, timeout=30) as c:
        assert c.put(f"/v1/blobs/{digest}", content=content).status_code == 201
        LocalBackend(live.settings.data_dir / "blobs").path_for(digest).unlink()
        assert c.post("/v1/blobs/missing", json={"digests": [digest]}).json()["missing"] == [digest]
        manifest, blobs = make_snapshot({"back.bin": content}, workload="vanished")
        assert push(c, manifest, blobs).status_code == 201  # uploads it again, then publishes
        assert c.get(f"/v1/blobs/{digest}").content == content
