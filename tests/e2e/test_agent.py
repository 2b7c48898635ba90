"""The agent daemon end to end: a real server on loopback, real CPU compiles, real signals.

Cold CPU compiles take ~35 s on two cores, so the module compiles cpu-tiny twice in all
(once per fingerprint) and shares one server across its tests, which run in order:

1. ``cachekeeper agent --once`` builds cpu-tiny: a verified snapshot that resolves; a second
   ``--once`` compiles nothing.
2. The daemon loop in-process: a round that finds everything warm, then an environment
   change (``CACHEKEEPER_FINGERPRINT_OVERRIDES``, the test-only way to simulate an upgraded
   Triton) and a newly registered broken workload: the next round reports the broken one
   with its traceback and still builds cpu-tiny for the new fingerprint. ``/v1/status``
   shows all of it.
3. Hanging workloads (no compile at all, on their own server): a per-build timeout is
   reported and the agent carries on; SIGTERM mid-build exits 0 at once, kills the
   children, publishes nothing and leaves no build dir behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachekeeper.allowlist import Allowlist
from cachekeeper.client.agent import AgentOptions, RoundReport, StopSignal, run_agent
from cachekeeper.client.api import CacheClient
from cachekeeper.fingerprint import collect, digest_of
from cachekeeper.server.settings import Settings
from cachekeeper.signing import generate_keypair
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.requires import require

pytestmark = pytest.mark.compile  # real torch.compile runs in children

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TINY_TEXT = (REPO / "examples" / "workloads" / "cpu-tiny.toml").read_text()
BROKEN_TOML = """\
name = "broken"
[[entrypoint]]
target = "fixtures_pkg.warmup:fx_traces_compiled"
kwargs = { size = 32 }
"""
HANG_TOML = """\
name = "{name}"
[[entrypoint]]
target = "fixtures_pkg.warmup:sleep"
kwargs = {{ seconds = 600 }}
"""
OVERRIDE = json.dumps({"triton": "9.9.9"})


@pytest.fixture(scope="module", autouse=True)
def _child_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Children import fixtures_pkg through PYTHONPATH; the agent's home is private."""
    require("torch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        mp.setenv("CACHEKEEPER_HOME", str(tmp_path_factory.mktemp("ck-home")))
        for name in ("CACHEKEEPER_TEST_FAKE_CUDA", "CACHEKEEPER_FINGERPRINT_OVERRIDES"):
            mp.delenv(name, raising=False)
        for name in ("CACHEKEEPER_SERVER", "CACHEKEEPER_TOKEN"):
            mp.delenv(name, raising=False)
        yield


def _serve(root: Path) -> LiveServer:
    return start_server(Settings(data_dir=root / "server-data", gc_grace_s=3600))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server with cpu-tiny registered."""
    live = _serve(tmp_path_factory.mktemp("fleet"))
    try:
        httpx.put(f"{live.url}/v1/workloads/cpu-tiny", content=TINY_TEXT).raise_for_status()
        yield live
    finally:
        live.stop()


def _agent_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(Path(sys.executable).with_name("cachekeeper")), "agent", *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _once(live: LiveServer, work: Path, *extra: str) -> tuple[dict[str, Any], str]:
    proc = _agent_cli("--server", live.url, "--once", "--device", "cpu", "--json",
                      "--work-dir", str(work), *extra)  # fmt: skip
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    (line,) = out.strip().splitlines()  # one JSON report per round
    return json.loads(line), err


def _by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["workload"]: o for o in report["outcomes"]}


def _status(live: LiveServer) -> dict[tuple[str, str], dict[str, Any]]:
    rows = httpx.get(f"{live.url}/v1/status").json()["status"]
    return {(r["workload"], r["fingerprint_digest"]): r for r in rows}


@pytest.fixture(scope="module")
def first_build(
    fleet: LiveServer, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], str, Path]:
    """``agent --once`` on a fresh server: (round report, stderr, work dir)."""
    work = tmp_path_factory.mktemp("agent") / "work"
    report, err = _once(fleet, work)
    return report, err, work


def test_once_builds_a_verified_snapshot_and_a_second_once_compiles_nothing(
    fleet: LiveServer, first_build: tuple[dict[str, Any], str, Path]
) -> None:
    report, err, work = first_build
    outcome = _by_name(report)["cpu-tiny"]
    assert outcome["status"] == "built" and outcome["prewarm_ran"], outcome
    assert outcome["reported"] and report["all_reported"]
    assert outcome["prewarm"]["status"] == "verified"
    assert "cpu-tiny: building on cpu" in err and "attention[0]" in err  # progress on stderr
    assert list(work.iterdir()) == []  # the build dir is gone after the push

    fingerprint = collect()
    assert report["fingerprint_digest"] == digest_of(fingerprint)
    with CacheClient(base_url=fleet.url) as client:
        found = client.resolve(fingerprint, workload="cpu-tiny", devices=["cpu"])
        assert found.verified and found.snapshot_id == outcome["snapshot_id"]
        manifest = client.get_manifest(outcome["snapshot_id"])
    assert manifest.workload_digest == hashlib.sha256(TINY_TEXT.encode()).hexdigest()
    assert manifest.stats and manifest.stats["verify"]["effective"]

    started = time.monotonic()
    again, _ = _once(fleet, work)
    skipped = _by_name(again)["cpu-tiny"]
    assert again["prewarms_run"] == 0 and not skipped["prewarm_ran"]
    assert skipped["status"] == "skipped" and skipped["snapshot_id"] == outcome["snapshot_id"]
    assert again["agent_id"] == report["agent_id"]  # same environment, same registration
    print(f"second --once took {time.monotonic() - started:.1f} s")
    row = _status(fleet)[("cpu-tiny", report["fingerprint_digest"])]
    assert row["status"] == "warm" and row["last_event"]["status"] == "skipped"


def test_environment_change_rebuilds_and_a_broken_workload_does_not_stop_the_others(
    fleet: LiveServer,
    first_build: tuple[dict[str, Any], str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old_digest = digest_of(collect())
    stop = StopSignal()
    lines: list[str] = []
    rounds: list[RoundReport] = []

    def between_rounds(report: RoundReport) -> None:
        rounds.append(report)
        if len(rounds) == 1:  # the environment changes and a workload arrives
            monkeypatch.setenv("CACHEKEEPER_FINGERPRINT_OVERRIDES", OVERRIDE)
            httpx.put(f"{fleet.url}/v1/workloads/broken", content=BROKEN_TOML).raise_for_status()
        else:
            stop.set()

    # A signing builder: its builds compile with the key hidden from them (Landlock; the
    # key under /tmp, so the builds get a TMPDIR of their own, issue 32).
    key_path, _pub, key_id = generate_keypair(tmp_path / "keys" / "builder")
    options = AgentOptions(
        devices=("cpu",),
        work_dir=tmp_path / "work",
        name="builder-a",
        allow=Allowlist.load(["fixtures_pkg.*"]),  # the broken workload's entrypoint is code
        sign_key=key_path,
    )
    with CacheClient(base_url=fleet.url) as client:
        run_agent(
            options,
            client=client,
            interval_s=0.01,
            stop=stop,
            log=lines.append,
            on_round=between_rounds,
        )
    first, second = rounds
    # The first build's snapshot is unsigned: not warm for a signing agent (issue 32: only a
    # verified snapshot its own key signed is), so round 1 builds it again, sandboxed.
    assert [(o.workload, o.status) for o in first.outcomes] == [("cpu-tiny", "built")]
    assert first.prewarms_run == 1 and not first.fingerprint_changed
    new_digest = digest_of(collect())
    assert second.fingerprint_changed and second.fingerprint_digest == new_digest != old_digest
    assert second.agent_id == first.agent_id  # one agent per name, whatever its environment
    broken, tiny = second.outcomes  # name order: the broken one ran first
    assert broken.workload == "broken" and broken.status == "cold_compile_broken"
    assert "symbolically trace a dynamo-optimized" in broken.detail
    assert any("symbolic_trace" in line for line in broken.traceback_tail)
    assert tiny.workload == "cpu-tiny" and tiny.status == "built" and tiny.prewarm_ran
    assert all(o.reported for o in second.outcomes)
    assert any("environment changed" in line for line in lines)
    assert list((tmp_path / "work").iterdir()) == []

    status = _status(fleet)
    assert status[("cpu-tiny", old_digest)]["status"] == "warm"
    assert status[("cpu-tiny", new_digest)]["status"] == "warm"
    assert status[("cpu-tiny", new_digest)]["snapshot_id"] == tiny.snapshot_id
    assert status[("broken", new_digest)]["status"] == "broken"
    assert status[("broken", new_digest)]["last_event"]["traceback_tail"] == list(
        broken.traceback_tail
    )
    assert status[("broken", old_digest)]["status"] == "missing"  # never built there
    with CacheClient(base_url=fleet.url) as client:
        agents = {a.id: a for a in client.list_agents()}
        assert second.agent_id in agents
        assert agents[second.agent_id].fingerprint["triton"] == "9.9.9"
        found = client.resolve(collect(), workload="cpu-tiny", devices=["cpu"])
        assert found.verified and found.snapshot_id == tiny.snapshot_id
        signature = client.get_manifest(tiny.snapshot_id).signature
        assert signature is not None and signature["key_id"] == key_id
        assert any(f"builds cannot read {key_path}" in line for line in lines)
        nothing = client.resolve(collect(), workload="broken", devices=["cpu"])
        assert nothing.snapshot_id is None


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def test_a_hang_times_out_and_sigterm_abandons_a_build_cleanly(tmp_path: Path) -> None:
    with _serve(tmp_path) as live:
        for name in ("hang-a", "hang-b"):
            toml = HANG_TOML.format(name=name)
            httpx.put(f"{live.url}/v1/workloads/{name}", content=toml).raise_for_status()
        work = tmp_path / "work"
        leftover = work / "build-someone-else"  # a folder the agent did not make: kept
        leftover.mkdir(parents=True)

        report, _ = _once(live, work, "--build-timeout", "5", "--allow", "fixtures_pkg.*")
        outcomes = _by_name(report)
        for name in ("hang-a", "hang-b"):  # the first hang did not stop the second
            assert outcomes[name]["status"] == "failed", outcomes[name]
            assert outcomes[name]["detail"].startswith("timeout: ") and outcomes[name]["reported"]
        assert list(work.iterdir()) == [leftover]

        proc = _agent_cli("--server", live.url, "--device", "cpu", "--work-dir", str(work),
                          "--interval", "3600", "--allow", "fixtures_pkg.*")  # fmt: skip
        assert proc.stderr is not None
        for line in proc.stderr:
            if "hang-a: building" in line:
                break
        deadline = time.monotonic() + 60
        while not _processes_mentioning(str(work / "build-hang-a-")):
            assert time.monotonic() < deadline, "no prewarm child started"
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        # Hang guard, not a speed claim: the child sleeps 600 s, so returning at all within
        # 60 s means it was abandoned, not waited for (the children-killed check below).
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "agent stopped" in err
        assert _processes_mentioning(str(work / "build-hang-a-")) == []  # children killed
        assert list(work.iterdir()) == [leftover]
        snapshots = httpx.get(f"{live.url}/v1/snapshots").json()["snapshots"]
        assert snapshots == []
        rows = {w: r for (w, _d), r in _status(live).items()}
        assert rows["hang-a"]["status"] == "failed"
        assert "abandoned" in rows["hang-a"]["last_event"]["detail"]
        assert rows["hang-b"]["last_event"]["detail"].startswith("timeout: ")  # round 1


def test_once_without_a_server_exits_non_zero(tmp_path: Path) -> None:
    with _serve(tmp_path) as live:
        url = live.url
    proc = _agent_cli("--server", url, "--once", "--device", "cpu", "--work-dir", str(tmp_path))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "[server_unavailable]" in err, err
    usage = _agent_cli("--once", "--device", "cpu")
    _, err = usage.communicate(timeout=60)
    assert usage.returncode == 2 and "no server" in err
    bad_device = _agent_cli("--server", url, "--once", "--device", "tpu")
    _, err = bad_device.communicate(timeout=60)
    assert bad_device.returncode == 2 and "'tpu'" in err


def test_sweep_removes_only_marked_build_dirs_of_dead_agents(tmp_path: Path) -> None:
    from cachekeeper.client.agent import MARKER, sweep_stale_builds

    gone = subprocess.Popen(["true"])  # once it is waited for, its pid names no process
    gone.wait()
    dirs = {
        "build-dead-1": str(gone.pid),  # an agent killed with SIGKILL: removed
        "build-live-1": str(os.getpid()),  # this very agent: kept
        "build-unmarked-1": None,  # not made by an agent: kept
    }
    for name, pid in dirs.items():
        (tmp_path / name / "inductor").mkdir(parents=True)
        if pid is not None:
            (tmp_path / name / MARKER).write_text(pid)
    (tmp_path / "other").mkdir()
    assert sweep_stale_builds(tmp_path) == [tmp_path / "build-dead-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "build-live-1",
        "build-unmarked-1",
        "other",
    ]
