"""The smaller breaks of issue 24's second attack, one test each: a blank trust variable,
a publish into our own folder, free-form reason codes as metric labels, reports inventing
environments, a 5,000-digit Range, terminal escapes from a manifest, a password in the
server URL, and a server clock that jumps back. Real servers on loopback, the real CLI."""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import string
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachekeeper.errors import ConfigInvalid
from cachekeeper.fingerprint import collect, digest_of
from cachekeeper.server.settings import Settings, load_settings
from cachekeeper.snapshot import snapshot_dir, write_archive
from cachekeeper.store import LocalStore
from tests.hardening.conftest import child_env, cli
from tests.helpers.live_server import TOKENS, LiveServer, start_server
from tests.helpers.slow_servers import FakeServer, answer_json, forward

TINY = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "cpu-tiny.toml"
FP: dict[str, Any] = {"schema": 1, "torch": "2.13.0+cpu", "python": "3.11", "gpus": [], "env": {}}


def _manifest(files: dict[str, bytes], **fields: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A manifest as JSON (built by hand: some of these are invalid on purpose) + its blobs."""
    blobs = {hashlib.sha256(d).hexdigest(): d for d in files.values()}
    body = {
        "format": 1,
        "workload": "wl",
        "workload_digest": None,
        "fingerprint": FP,
        "devices": ["cpu"],
        "files": [
            {
                "path": p,
                "digest": hashlib.sha256(d).hexdigest(),
                "size_bytes": len(d),
                "mode": 0o644,
            }
            for p, d in sorted(files.items())
        ],
        "stats": None,
        **fields,
    }
    return body, blobs


def _publish(c: httpx.Client, body: dict[str, Any], blobs: dict[str, bytes]) -> httpx.Response:
    for digest, data in blobs.items():
        assert c.put(f"/v1/blobs/{digest}", content=data).status_code in (200, 201)
    return c.post("/v1/snapshots", content=json.dumps(body))


def test_a_blank_trusted_keys_variable_refuses_every_snapshot(
    open_server: LiveServer, tmp_path: Path, reliability
) -> None:
    """Set to nothing, CACHEKEEPER_TRUSTED_KEYS used to turn signature checks off; it now
    refuses every snapshot, as a key file that cannot be read does."""
    src = tmp_path / "src"
    (src / "fxgraph" / "ab").mkdir(parents=True)
    (src / "fxgraph" / "ab" / "entry").write_bytes(b"unsigned entry" * 50)
    store = LocalStore(home=tmp_path / "store")
    manifest = snapshot_dir(src, store=store, workload="wl", fingerprint=collect())
    archive = tmp_path / "snap.tar.zst"
    write_archive(manifest, store.blobs, archive)
    with httpx.Client(base_url=open_server.url) as c:
        for entry in manifest.files:
            with store.blobs.open(entry.digest) as fh:
                c.put(f"/v1/blobs/{entry.digest}", content=fh.read())
        assert c.post("/v1/snapshots", content=manifest.to_json()).status_code == 201
    values = ["", "   ", ":"]
    for value in values:
        env = child_env(tmp_path / "home", CACHEKEEPER_TRUSTED_KEYS=value)
        cache = tmp_path / f"cache-{len(value)}"
        proc = subprocess.run(
            cli(
                "prejob", "--workload", "wl", "--server", open_server.url, "--cache-dir", str(cache)
            ),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert "names no key file" in proc.stderr and "compile cold" in proc.stderr, proc.stderr
        assert not (cache / "fxgraph").exists()
        restored = subprocess.run(
            cli("restore", str(archive), "--cache-dir", str(tmp_path / f"r-{len(value)}")),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert restored.returncode == 1 and "names no key file" in restored.stderr, restored.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CACHEKEEPER_TRUSTED_KEYS", "  ")
        with pytest.raises(ConfigInvalid, match="CACHEKEEPER_TRUSTED_KEYS"):
            load_settings(data_dir=tmp_path / "server")
    reliability.record(
        "CACHEKEEPER_TRUSTED_KEYS set to '', '   ' or ':': `prejob` starts cold and `restore`"
        " refuses (as for an unreadable key file), `serve` refuses a blank value; before,"
        " signature checks were silently off",
        tries=len(values) * 2 + 1,
        outcome="refused",
        area="signatures",
    )


def test_a_publish_into_the_state_folder_is_refused(open_server: LiveServer, reliability) -> None:
    paths = [".cachekeeper/restored/" + "a" * 64, ".cachekeeper/lock", ".cachekeeper"]
    with httpx.Client(base_url=open_server.url) as c:
        for path in paths:
            body, blobs = _manifest({path: b"planted", "fxgraph/ok": b"fine"})
            answer = _publish(c, body, blobs)
            assert answer.status_code == 422, answer.text
            assert answer.json()["error"] == "unsafe_path", answer.text
        assert c.get("/v1/snapshots").json()["snapshots"] == []
    reliability.record(
        "publish of a manifest naming a path inside `.cachekeeper/` (a marker, the lock, the"
        " folder itself): 422 unsafe_path, nothing published (every node's restore refused it)",
        tries=len(paths),
        outcome="refused",
        area="attacker input",
    )


def test_free_form_reason_codes_make_no_new_metric_labels(
    authed_server: LiveServer, reliability
) -> None:
    rng = random.Random(24)
    codes = ["".join(rng.choices(string.ascii_lowercase, k=20)) for _ in range(50)]
    with httpx.Client(
        base_url=authed_server.url, headers={"Authorization": "Bearer read-token"}
    ) as c:
        for code in [*codes, "server_unavailable"]:
            report = {
                "phase": "prejob",
                "outcome": "cold",
                "workload": "wl",
                "fingerprint_digest": "0" * 64,
                "reason_code": code,
            }
            assert c.post("/v1/reports", json=report).status_code == 201
        text = c.get("/metrics").text
    lines = [
        line for line in text.splitlines() if line.startswith("cachekeeper_cold_starts_total{")
    ]
    assert not any(code in text for code in codes)
    assert any('reason="other"' in line for line in lines), lines
    assert any('reason="server_unavailable"' in line for line in lines), lines
    assert len(lines) <= 3, lines
    reliability.record(
        "50 job reports with made-up reason codes (read token): one `other` label in"
        " /metrics, not 50 new Prometheus series; a known code keeps its own",
        tries=50,
        outcome="refused",
        area="bounded requests",
    )


def test_reports_with_random_fingerprints_add_no_environments(tmp_path: Path, reliability) -> None:
    # 201 reports of 201 jobs from one token: past its budget of new jobs in an hour (100,
    # tests/hardening/test_table_budgets.py); raised here, where the digests are the point.
    settings = Settings(data_dir=tmp_path / "data", tokens=TOKENS, report_jobs_per_token=1000)
    with (
        start_server(settings) as live,
        httpx.Client(base_url=live.url, headers={"Authorization": "Bearer write-token"}) as c,
    ):
        toml = TINY.read_text().replace('name = "cpu-tiny"', 'name = "wl"')
        answer = c.put("/v1/workloads/wl", content=toml)
        assert answer.status_code == 200, answer.text
        agent_fp = {**FP, "agent": 1}
        body = {"name": "builder", "fingerprint": agent_fp, "devices": ["cpu"], "version": "1"}
        assert c.post("/v1/agents", json=body).status_code == 200
        rng = random.Random(7)
        fake = [f"{rng.getrandbits(256):064x}" for _ in range(200)]
        reader = {"Authorization": "Bearer read-token"}
        for digest in [*fake, digest_of(agent_fp)]:
            report = {
                "phase": "prejob",
                "outcome": "cold",
                "workload": "wl",
                "fingerprint_digest": digest,
            }
            assert c.post("/v1/reports", json=report, headers=reader).status_code == 201
        rows = c.get("/v1/status", headers=reader).json()["status"]
        page = c.get("/", headers=reader).text
    assert [r["fingerprint_digest"] for r in rows] == [digest_of(agent_fp)]
    assert rows[0]["jobs"]["cold"] == 1  # the vouched environment's report still counts
    assert not any(d[:12] in page for d in fake)
    reliability.record(
        "200 job reports (read token) naming random fingerprint digests: no new environment"
        " in /v1/status or the status page (only those an agent or a snapshot vouches for)",
        tries=200,
        outcome="refused",
        area="bounded requests",
    )


def test_a_huge_number_in_a_range_header_is_416_not_500(
    open_server: LiveServer, reliability
) -> None:
    data = b"hello range"
    digest = hashlib.sha256(data).hexdigest()
    big = "9" * 5000
    with httpx.Client(base_url=open_server.url) as c:
        assert c.put(f"/v1/blobs/{digest}", content=data).status_code == 201
        answers = {
            header: c.get(f"/v1/blobs/{digest}", headers={"Range": header})
            for header in (f"bytes={big}-", f"bytes={big}-{big}", f"bytes=0-{big}", f"bytes=-{big}")
        }
    assert answers[f"bytes={big}-"].status_code == 416
    assert answers[f"bytes={big}-{big}"].status_code == 416
    assert answers[f"bytes=0-{big}"].status_code == 206  # to the end, as RFC 9110 says
    assert answers[f"bytes=0-{big}"].content == data
    assert answers[f"bytes=-{big}"].content == data
    reliability.record(
        "blob GET with a 5,000-digit number in its Range header (start, end, suffix):"
        " 416 or the bytes to the end, never a 500",
        tries=len(answers),
        outcome="refused",
        area="bounded requests",
    )


ESCAPE = "\x1b]0;owned\x07\x1b[2J"


def test_terminal_escapes_from_a_manifest_are_refused_and_never_printed_raw(
    tmp_path: Path, reliability
) -> None:
    data = tmp_path / "data"
    with start_server(Settings(data_dir=data)) as live, httpx.Client(base_url=live.url) as c:
        refused = [
            _publish(c, *_manifest({"a/b": b"x"}, workload=f"wl{ESCAPE}")),
            _publish(c, *_manifest({"a/b": b"x"}, devices=[f"cpu{ESCAPE}"])),
        ]
        assert [r.status_code for r in refused] == [422, 422], [r.text for r in refused]
        ok = _publish(c, *_manifest({"a/b": b"x"}))
        assert ok.status_code == 201
        # What an older server accepted is still in its catalog: the CLI must not print it raw.
        with sqlite3.connect(data / "meta.sqlite") as db:
            db.execute(
                "UPDATE snapshots SET workload = ?, devices = ?",
                [f"wl{ESCAPE}", json.dumps([ESCAPE])],
            )
        proc = subprocess.run(
            cli("snapshots", "ls", "--server", live.url),
            env=child_env(tmp_path / "home"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout, repr(proc.stdout)
    assert "\\x1b" in proc.stdout
    reliability.record(
        "manifest whose workload or devices hold terminal escape sequences: publish 422;"
        " one an older server stored is printed escaped (`\\x1b`) by `snapshots ls`",
        tries=3,
        outcome="refused",
        area="attacker input",
    )


def test_a_password_in_the_server_url_is_never_echoed_or_reported(
    tmp_path: Path, reliability
) -> None:
    """A real server stores the reports; a relay in front of it answers resolve with a
    503 (so prejob's cold line names the server) and passes the rest through."""
    error = {"error": "server_unavailable", "detail": "maintenance"}
    data = tmp_path / "data"
    with start_server(Settings(data_dir=data)) as live:
        server = FakeServer({"/": forward(live.url), "/v1/resolve": answer_json(error, status=503)})
        try:
            url = server.url.replace("http://", "http://alice:s3cret-pw@")
            cache = tmp_path / "cache"
            runs = [
                subprocess.run(
                    cli(*args, "--server", url, "--cache-dir", str(cache), "--timeout", "10"),
                    env=child_env(tmp_path / "home"),
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                for args in (
                    ("prejob", "--workload", "wl"),
                    ("postjob", "--workload", "wl", "--strict"),
                )
            ]
            reports = [r.body.decode() for r in server.requests if r.path == "/v1/reports"]
        finally:
            server.close()
        with sqlite3.connect(data / "meta.sqlite") as db:
            stored = db.execute("SELECT * FROM job_reports").fetchall()
    assert len(stored) == len(reports) == 2, (stored, reports)  # both hooks reported
    assert not any("s3cret-pw" in repr(row) for row in stored), stored
    assert "compile cold" in runs[0].stderr and "127.0.0.1" in runs[0].stderr, runs[0].stderr
    for proc in runs:
        assert "s3cret-pw" not in proc.stderr + proc.stdout, proc.stderr
    assert reports and not any("s3cret-pw" in body for body in reports), reports
    reliability.record(
        "server URL with a user name and password (http://alice:PASSWORD@host): never on"
        " stderr, in `prejob`'s cold line or `postjob`'s, nor in the job report stored on the"
        " server",
        tries=2,
        outcome="kept",
        area="configuration",
    )


def test_a_server_clock_that_jumps_back_does_not_reorder_snapshots(
    tmp_path: Path, reliability
) -> None:
    data = tmp_path / "data"
    with start_server(Settings(data_dir=data)) as live, httpx.Client(base_url=live.url) as c:
        older = _publish(c, *_manifest({"a/b": b"older"}))
        newer = _publish(c, *_manifest({"a/b": b"newer"}))
        assert older.status_code == newer.status_code == 201
        older_id, newer_id = older.json()["id"], newer.json()["id"]
        # The clock jumped back a day before the second publish: its created_at is earlier.
        with sqlite3.connect(data / "meta.sqlite") as db:
            db.execute(
                "UPDATE snapshots SET created_at = '2000-01-01T00:00:00.000000+00:00' WHERE id = ?",
                [newer_id],
            )
        resolved = c.post("/v1/resolve", json={"fingerprint": FP, "workload": "wl"}).json()
        listed = [s["id"] for s in c.get("/v1/snapshots").json()["snapshots"]]
    assert resolved["snapshot"]["id"] == newer_id
    assert listed == [newer_id, older_id]
    reliability.record(
        "server clock jumped back between two publishes: resolve still picks, and the list"
        " still shows first, the snapshot published last (ordered by sequence, not time)",
        tries=1,
        outcome="kept",
        area="server state",
    )
