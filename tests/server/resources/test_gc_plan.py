"""What a GC plans (``POST /v1/gc``), decision by decision, on the real app in-process.

Each test builds a store through the HTTP API (uploads, publishes, pins, resolves), then
asks for the plan with ``dry_run`` and checks it, then that a dry run changed nothing and
the wet run did what the plan said. The server is ``create_app(settings)`` behind httpx's
ASGI transport (tests/helpers/in_process.py): no uvicorn, so each test takes
milliseconds. The races between a plan and its execution are in test_gc_races.py (they
need a second request served while the first one waits: a live server).

Stored sizes are read the way an operator reads them: the ``cachekeeper_store_bytes``
gauge of ``/metrics`` before and after each publish.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from cachekeeper.backends.local import LocalBackend
from tests.helpers.metrics import scrape
from tests.server.conftest import FINGERPRINT, make_snapshot, push, random_files


def stored_bytes(c: httpx.Client) -> int:
    return int(scrape(c, "cachekeeper_store_bytes"))


def publish(c: httpx.Client, workload: str, files: dict[str, bytes]) -> tuple[str, int]:
    """Publish a snapshot of ``files``; (its id, the bytes its new blobs added to the store)."""
    before = stored_bytes(c)
    manifest, blobs = make_snapshot(files, workload=workload)
    answer = push(c, manifest, blobs)
    assert answer.status_code == 201, answer.text
    return manifest.id, stored_bytes(c) - before


def gc(c: httpx.Client, *, dry_run: bool) -> dict[str, Any]:
    answer = c.post("/v1/gc", json={"dry_run": dry_run})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["dry_run"] is dry_run
    return body


def snapshots(c: httpx.Client) -> set[str]:
    return {s["id"] for s in c.get("/v1/snapshots").json()["snapshots"]}


def use(c: httpx.Client, workload: str) -> None:
    """A node resolves ``workload``: its snapshot becomes the most recently used."""
    answer = c.post("/v1/resolve", json={"fingerprint": FINGERPRINT, "workload": workload})
    assert answer.json()["snapshot"] is not None, answer.text


def the_plan_is_what_the_run_does(c: httpx.Client) -> dict[str, Any]:
    """A dry run, then the same store is unchanged, then a wet run doing exactly that."""
    kept, total = snapshots(c), stored_bytes(c)
    plan = gc(c, dry_run=True)
    assert snapshots(c) == kept and stored_bytes(c) == total, "a dry run changed the store"
    done = gc(c, dry_run=False)
    assert {**done, "dry_run": True} == plan
    assert stored_bytes(c) == total - plan["bytes_freed"]
    assert snapshots(c) == kept - set(plan["snapshots_evicted"])
    return plan


def test_without_a_cap_nothing_is_evicted_however_full(in_process_server) -> None:
    c = in_process_server(gc_grace_s=0).client
    for i in range(3):
        publish(c, f"w{i}", random_files(3, size=50_000, seed=i, prefix=f"s{i}"))
    plan = the_plan_is_what_the_run_does(c)
    assert plan["snapshots_evicted"] == [] and plan["blobs_deleted"] == 0
    assert plan["bytes_freed"] == 0 and len(snapshots(c)) == 3


def test_the_least_recently_used_go_first_and_eviction_stops_under_the_cap(
    in_process_server,
) -> None:
    live = in_process_server(gc_grace_s=3600)
    c = live.client
    ids, sizes = {}, {}
    for seed, name in enumerate("abc"):
        files = random_files(2, size=40_000, seed=seed, prefix=name)
        ids[name], sizes[name] = publish(c, name, files)
    use(c, "a")  # a is now the most recently used; b, then c, were never used since publish
    total = stored_bytes(c)

    live.settings.max_store_bytes = total - 1  # one byte over: the LRU one alone goes
    plan = gc(c, dry_run=True)
    assert plan["snapshots_evicted"] == [ids["b"]]
    assert plan["bytes_freed"] == sizes["b"] and plan["blobs_deleted"] == 2

    live.settings.max_store_bytes = total - sizes["b"] - 1  # b is not enough: c goes too
    plan = gc(c, dry_run=True)
    assert plan["snapshots_evicted"] == [ids["b"], ids["c"]]
    assert plan["bytes_freed"] == sizes["b"] + sizes["c"]

    # evicted blobs go at once: the grace period is for blobs no snapshot ever used
    plan = the_plan_is_what_the_run_does(c)
    assert plan["blobs_in_grace"] == 0 and snapshots(c) == {ids["a"]}
    assert stored_bytes(c) <= live.settings.max_store_bytes


def test_a_pinned_snapshot_is_never_evicted_even_to_reach_the_cap(in_process_server) -> None:
    live = in_process_server(gc_grace_s=0)
    c = live.client
    old, _ = publish(c, "old", random_files(2, size=40_000, seed=1, prefix="old"))
    new, new_size = publish(c, "new", random_files(2, size=40_000, seed=2, prefix="new"))
    assert c.post(f"/v1/snapshots/{old}/pin").json()["pinned"] is True
    live.settings.max_store_bytes = 1  # unreachable: everything unpinned goes, and no more
    plan = the_plan_is_what_the_run_does(c)
    assert plan["snapshots_evicted"] == [new] and plan["bytes_freed"] == new_size
    assert snapshots(c) == {old}
    assert c.get(f"/v1/snapshots/{old}/archive").status_code == 200


def test_a_blob_a_kept_snapshot_shares_is_neither_freed_nor_counted(in_process_server) -> None:
    live = in_process_server(gc_grace_s=0)
    c = live.client
    shared = {"shared.bin": random_files(1, size=60_000, seed=99)["f/0000.bin"]}
    kept, _ = publish(c, "kept", shared | random_files(1, size=10_000, seed=1, prefix="k"))
    gone, own = publish(c, "gone", shared | random_files(1, size=10_000, seed=2, prefix="g"))
    use(c, "kept")
    live.settings.max_store_bytes = stored_bytes(c) - 1
    plan = the_plan_is_what_the_run_does(c)
    assert plan["snapshots_evicted"] == [gone]
    # only the evicted snapshot's own blob is freed: ``own`` is what its publish added
    assert plan["blobs_deleted"] == 1 and plan["bytes_freed"] == own
    manifest = c.get(f"/v1/snapshots/{kept}").json()
    digests = sorted({f["digest"] for f in manifest["files"]})
    assert c.post("/v1/blobs/missing", json={"digests": digests}).json()["missing"] == []


def test_an_unreferenced_blob_waits_out_the_grace_period(in_process_server) -> None:
    """An upload waiting for its publish: kept, and the plan says until when."""
    c = in_process_server(gc_grace_s=3600).client
    data = b"uploaded, publish still to come" * 100
    digest = hashlib.sha256(data).hexdigest()
    before = stored_bytes(c)
    uploaded_at = datetime.now(UTC)
    assert c.put(f"/v1/blobs/{digest}", content=data).status_code == 201
    plan = the_plan_is_what_the_run_does(c)
    assert plan["blobs_deleted"] == 0 and plan["bytes_freed"] == 0
    assert plan["blobs_in_grace"] == 1 and plan["bytes_in_grace"] == stored_bytes(c) - before
    assert plan["grace_s"] == 3600
    ends = datetime.fromisoformat(plan["grace_ends_at"])
    assert abs(ends - (uploaded_at + timedelta(hours=1))) < timedelta(seconds=30)
    assert c.post("/v1/blobs/missing", json={"digests": [digest]}).json()["missing"] == []


def test_past_the_grace_period_an_unreferenced_blob_is_freed(in_process_server) -> None:
    c = in_process_server(gc_grace_s=0).client
    kept, _ = publish(c, "kept", random_files(1, size=5_000, prefix="k"))
    data = b"uploaded and never published" * 100
    digest = hashlib.sha256(data).hexdigest()
    before = stored_bytes(c)
    assert c.put(f"/v1/blobs/{digest}", content=data).status_code == 201
    added = stored_bytes(c) - before
    plan = the_plan_is_what_the_run_does(c)
    assert plan["blobs_deleted"] == 1 and plan["bytes_freed"] == added > 0
    assert plan["blobs_in_grace"] == 0 and plan["snapshots_evicted"] == []
    assert c.post("/v1/blobs/missing", json={"digests": [digest]}).json()["missing"] == [digest]
    assert snapshots(c) == {kept}


def test_a_deleted_snapshots_blobs_wait_out_the_grace_period_too(in_process_server) -> None:
    """Unlike an eviction, a delete is a person's act: its blobs stay for the grace period
    (a publish that needs them again finds them), then a later GC frees them."""
    live = in_process_server(gc_grace_s=3600)
    c = live.client
    gone, size = publish(c, "gone", random_files(2, size=20_000, prefix="d"))
    assert c.delete(f"/v1/snapshots/{gone}").status_code == 204
    plan = gc(c, dry_run=True)
    assert plan["blobs_deleted"] == 0 and plan["blobs_in_grace"] == 2
    assert plan["bytes_in_grace"] == size
    live.settings.gc_grace_s = 0
    plan = the_plan_is_what_the_run_does(c)
    assert plan["blobs_deleted"] == 2 and plan["bytes_freed"] == size
    assert stored_bytes(c) == 0


def test_a_blob_file_without_a_row_is_freed_only_past_the_grace_period(in_process_server) -> None:
    """What a crash between writing a blob's file and recording its row leaves behind."""
    live = in_process_server(gc_grace_s=3600)
    content = b"a file the catalog never heard of" * 50
    digest = hashlib.sha256(content).hexdigest()
    LocalBackend(live.settings.data_dir / "blobs").put([content], digest=digest)
    path = LocalBackend(live.settings.data_dir / "blobs").path_for(digest)
    assert gc(live.client, dry_run=False)["blobs_deleted"] == 0  # too new: maybe uploading
    assert path.exists()
    live.settings.gc_grace_s = 0
    plan = gc(live.client, dry_run=True)
    assert plan["blobs_deleted"] == 1 and plan["bytes_freed"] == path.stat().st_size
    assert path.exists()  # the dry run kept it
    assert gc(live.client, dry_run=False) == {**plan, "dry_run": False}
    assert not path.exists()
