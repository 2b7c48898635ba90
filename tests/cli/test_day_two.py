"""Issue 25, "day two": status that can be believed, against a real server on loopback.

- staleness compares digests, not times: re-registering the identical TOML keeps a warm
  row warm; a changed one makes it stale, in the JSON, in ``cachekeeper status`` and on
  the page;
- an unknown ``--workload`` is an error with a did-you-mean (``status``), a line on stderr
  (``postjob``, which never fails the job unless ``--strict``) and the cold reason
  (``prejob``);
- a registered workload whose only snapshot is unverified (pushed by hand, no agent yet)
  is a row, and the page shows it instead of "No workloads or environments yet".
"""

from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.push import push as push_dir
from cachekeeper.store import LocalStore
from cachekeeper.wire import utc_now
from tests.cli.conftest import ck, run
from tests.helpers.caches import make_cache
from tests.helpers.live_server import LiveServer
from tests.server.conftest import make_snapshot, push

TOML = 'name = "drafter-gqa"\n[[entrypoint]]\ntarget = "pkg.mod:step"\n'


def _register(url: str, text: str) -> None:
    httpx.put(f"{url}/v1/workloads/drafter-gqa", content=text).raise_for_status()


def _publish(url: str, *, verified: bool | None, workload_digest: str | None) -> str:
    manifest, blobs = make_snapshot({"a.bin": b"a"}, workload="drafter-gqa", verified=verified)
    manifest = replace(manifest, workload_digest=workload_digest)
    with httpx.Client(base_url=url) as c:
        assert push(c, manifest, blobs).status_code == 201
    return manifest.id


def _rows(url: str) -> list[dict]:
    return json.loads(run("status", "--server", url, "--json"))["status"]


def test_an_identical_registration_keeps_cells_warm_and_a_changed_one_is_stale(
    open_server: LiveServer,
) -> None:
    url = open_server.url
    _register(url, TOML)
    _publish(url, verified=True, workload_digest=hashlib.sha256(TOML.encode()).hexdigest())
    (row,) = _rows(url)
    assert row["status"] == "warm" and row["stale"] is None
    before = httpx.get(f"{url}/v1/workloads").json()["workloads"][0]["updated_at"]

    _register(url, TOML)  # the same file again: nothing changed
    (row,) = _rows(url)
    assert row["status"] == "warm" and row["stale"] is None, row
    assert httpx.get(f"{url}/v1/workloads").json()["workloads"][0]["updated_at"] == before
    assert "stale" not in run("status", "--server", url)
    assert 'data-state="stale"' not in httpx.get(f"{url}/ui").text

    _register(url, TOML + "kwargs = { seq_len = 8192 }\n")  # the workload changed
    (row,) = _rows(url)
    assert row["status"] == "warm" and "the workload file changed" in row["stale"], row
    text = run("status", "--server", url).splitlines()
    assert text[2].startswith("  ! stale: the workload file changed since snapshot"), text
    assert 'data-state="stale"' in httpx.get(f"{url}/ui").text


def test_an_unknown_workload_is_an_error_with_a_did_you_mean(
    open_server: LiveServer, tmp_path: Path
) -> None:
    url = open_server.url
    _register(url, TOML)
    typo = run("status", "--server", url, "--workload", "drafter-gpa", code=1)
    assert "no workload 'drafter-gpa' is registered" in typo
    assert "(did you mean 'drafter-gqa'?)" in typo
    registered = run("status", "--server", url)  # registered, nothing built: says what exists
    assert "1 workload(s) registered (drafter-gqa), but no agent has registered" in registered

    cache = tmp_path / "cache"
    cache.mkdir()
    pre = ck("prejob", "--workload", "drafter-gpa", "--cache-dir", str(cache), "--server", url,
             cwd=tmp_path)  # fmt: skip
    assert pre.returncode == 0 and "(did you mean 'drafter-gqa'?)" in pre.stderr, pre.stderr
    post = ck("postjob", "--workload", "drafter-gpa", "--cache-dir", str(cache), "--server", url,
              cwd=tmp_path)  # fmt: skip
    assert post.returncode == 0, post.stderr
    assert "error: no workload 'drafter-gpa' is registered on this server (did you mean" in (
        post.stderr
    )
    strict = ck("postjob", "--workload", "drafter-gpa", "--cache-dir", str(cache), "--strict",
                "--server", url, "--json", cwd=tmp_path)  # fmt: skip
    assert strict.returncode == 1 and json.loads(strict.stdout)["unknown_workload"]
    good = ck("postjob", "--workload", "drafter-gqa", "--cache-dir", str(cache), "--server", url,
              "--strict", cwd=tmp_path)  # fmt: skip
    assert good.returncode == 0 and "error" not in good.stderr, good.stderr


def test_a_registered_workload_with_only_an_unverified_snapshot_is_shown(
    open_server: LiveServer,
) -> None:
    url = open_server.url
    _register(url, TOML)
    snapshot_id = _publish(url, verified=None, workload_digest=None)
    (row,) = _rows(url)
    assert (row["status"], row["snapshot_id"]) == ("warm", snapshot_id)
    page = httpx.get(f"{url}/ui").text
    assert "No workloads or environments yet" not in page
    assert 'data-state="warm_unverified"' in page
    plain = run("status", "--server", url).splitlines()
    assert plain[1].split()[:3] == ["drafter-gqa", row["fingerprint_digest"][:12], "warm"]


def test_explain_and_inspect_take_the_servers_snapshot_id(
    open_server: LiveServer, tmp_path: Path, monkeypatch
) -> None:
    """postjob points at `cachekeeper explain` with the server's snapshot id; explain took
    only archives and local ids. A match now says the difference must be in the calls."""
    monkeypatch.setenv("CACHEKEEPER_HOME", str(tmp_path / "empty-home"))  # not in the store
    src = tmp_path / "src"
    make_cache(src)
    with CacheClient(base_url=open_server.url) as client:
        pushed = push_dir(src, client=client, workload="w", store=LocalStore(home=tmp_path / "b"))
    ref = pushed.snapshot_id[:10]
    local_only = run("explain", ref, code=1)
    assert "pass --server or set CACHEKEEPER_SERVER" in local_only
    text = run("explain", ref, "--server", open_server.url, "--device", "cpu")
    assert f"snapshot {pushed.snapshot_id[:12]} suits this node: the fingerprints match" in text
    assert "the difference is in the calls" in text and "mask/score code" in text
    body = json.loads(run("explain", ref, "--server", open_server.url, "--device", "cpu", "--json"))
    assert body["compatible"] is True and "shapes" in body["advice"]
    shown = run("inspect", ref, "--server", open_server.url).splitlines()
    assert shown[0].split() == ["id", pushed.snapshot_id] and shown[1].split() == [
        "source",
        "server",
    ]


# -- operator commands ---------------------------------------------------------------------
def test_gc_says_what_it_keeps_in_the_grace_period_and_when_it_goes(
    open_server: LiveServer,
) -> None:
    """`snapshots rm` then `gc --server` freed nothing for an hour (gc_grace_s) while the
    help said "at the next GC": both now say what GC frees and when, --dry-run too."""
    url = open_server.url
    snapshot_id = _publish(url, verified=True, workload_digest=None)
    assert "once unused for the server's grace period" in run(
        "snapshots", "rm", snapshot_id[:8], "--yes", "--server", url
    )
    for dry in (["--dry-run"], []):
        text = run("gc", "--server", url, *dry)
        assert "1 unreferenced blobs" in text and "a gc after" in text, text
        body = json.loads(run("gc", "--server", url, *dry, "--json"))
        assert (body["blobs_deleted"], body["blobs_in_grace"], body["grace_s"]) == (0, 1, 3600)
        assert body["grace_ends_at"] > utc_now(), body


def test_gc_and_ls_speak_one_vocabulary_locally_and_on_the_server(
    open_server: LiveServer, ck_home: Path, cache: Path
) -> None:
    url = open_server.url
    _publish(url, verified=True, workload_digest=None)
    run("snapshot", str(cache))
    local, server = (
        json.loads(run("ls", "--json")),
        json.loads(run("snapshots", "ls", "--server", url, "--json")),
    )
    assert local.keys() == server.keys() == {"snapshots"}
    shared = {"id", "workload", "fingerprint_digest", "devices", "verified", "signed",
              "size_bytes", "file_count", "created_at"}  # fmt: skip
    assert shared <= local["snapshots"][0].keys() and shared <= server["snapshots"][0].keys()
    for dry in (["--dry-run"], []):
        local_gc = json.loads(run("gc", *dry, "--json"))
        server_gc = json.loads(run("gc", "--server", url, *dry, "--json"))
        assert local_gc.keys() == server_gc.keys(), (local_gc, server_gc)
    removed = json.loads(run("rm", local["snapshots"][0]["id"], "--yes", "--json"))
    assert {"snapshots_removed", "blobs_deleted", "bytes_freed", "dry_run"} == removed.keys()


@pytest.mark.slow  # waits out each command's timeout
def test_operator_commands_give_up_on_a_hung_server_at_the_timeout(tmp_path: Path) -> None:
    """They used to wait about two minutes (30 s per attempt, 3 retries)."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # connections complete in the backlog; nothing ever answers
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    try:
        for command in (["snapshots", "ls"], ["status"], ["workload", "ls"], ["gc", "--server"]):
            args = [*command] if command[-1] == "--server" else [*command, "--server"]
            proc = ck(*args, url, "--timeout", "1", cwd=tmp_path)  # ck: a 300 s hang guard
            assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
            assert "timed out" in proc.stderr and url in proc.stderr, proc.stderr
    finally:
        hung.close()
    assert "default: 10.0" in run("snapshots", "ls", "--help")


def test_the_page_names_registered_workloads_before_any_environment(
    open_server: LiveServer,
) -> None:
    _register(open_server.url, TOML)
    page = httpx.get(f"{open_server.url}/ui").text
    assert "No workloads or environments yet" not in page
    assert "Registered: drafter-gqa. No environment yet" in page
