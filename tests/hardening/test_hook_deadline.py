"""The hook's deadline is a promise (issue 24): ``prejob --timeout T`` and ``postjob
--timeout T`` end within T + 1 s under every fault, and never export an unusable dir.

Every fault is a real one: a server on loopback that trickles its answer a byte a second,
one that stalls, one that sends a gigabyte of JSON, an object store whose later ranges
trickle, an ``nvidia-smi`` on PATH that hangs. Only NVML is faked (a ``pynvml`` module
whose init hangs), because no GPU driver exists here. The hook runs as the real CLI in a
fresh process, and the test measures that process's wall time from start to exit: the
bound asserted is the contract itself (T + 1 s), not a speed target, and T is small so
the tests are quick.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cachekeeper.fingerprint import collect
from cachekeeper.snapshot import snapshot_dir, write_archive
from cachekeeper.store import LocalStore
from cachekeeper.wire import ResolveAnswer, Summary, to_dict
from tests.hardening.conftest import child_env
from tests.helpers.slow_servers import FakeServer, answer_json, dribble, huge_json, ranges, stall

T = 2.0  # the hook's --timeout in these tests
BOUND = T + 1.0  # the contract
MISS = to_dict(ResolveAnswer(snapshot=None, verified=False, exact=False, near_misses=()))
STORED = {"id": 1, "at": "2026-01-01T00:00:00.000000+00:00"}


@dataclass(frozen=True)
class Run:
    elapsed_s: float
    returncode: int
    stdout: str
    stderr: str
    max_rss_mb: float


# Runs the hook and reports its wall time and peak RSS. Through this small parent, because
# a child of the test process would count the test process's own peak (Linux carries the
# high-water mark of the memory a child was forked from across exec).
_MEASURE = """
import json, resource, subprocess, sys, time
started = time.monotonic()
code = subprocess.call(sys.argv[2:])
took = time.monotonic() - started
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
with open(sys.argv[1], "w") as out:
    json.dump({"elapsed_s": took, "max_rss_kb": peak}, out)
sys.exit(code)
"""


def _run(
    args: list[str], env: dict[str, str], tmp_path: Path, *, kill_after_s: float = 30.0
) -> Run:
    """The CLI in a fresh process: its wall time from start to exit, and its peak RSS."""
    out, err, measured = tmp_path / "stdout", tmp_path / "stderr", tmp_path / "measured.json"
    command = [sys.executable, "-c", _MEASURE, str(measured), sys.executable, "-m", "cachekeeper"]
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [*command, *args], env=env, stdout=o, stderr=e, start_new_session=True
        )
        try:
            proc.wait(kill_after_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the hook too, not only the measuring parent
            proc.wait()
    found = json.loads(measured.read_text()) if measured.exists() else {}
    return Run(
        elapsed_s=found.get("elapsed_s", kill_after_s),
        returncode=proc.returncode,
        stdout=out.read_text(),
        stderr=err.read_text(),
        max_rss_mb=found.get("max_rss_kb", 0) / 1024,
    )


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return child_env(tmp_path / "home", **extra)


def _hook(command: str, server: FakeServer, cache: Path) -> list[str]:
    """``prejob`` / ``postjob`` arguments against ``server`` with ``--timeout T``."""
    return [command, "--workload", "wl", "--server", server.url] + [
        "--cache-dir",
        str(cache),
        "--timeout",
        str(T),
    ]


def _prejob(server: FakeServer, tmp_path: Path, env: dict[str, str]) -> Run:
    return _run(_hook("prejob", server, tmp_path / "cache"), env, tmp_path)


def _assert_cold_in_time(run: Run, cache: Path) -> None:
    assert run.returncode == 0, run.stderr
    assert run.elapsed_s <= BOUND, (
        f"took {run.elapsed_s:.2f} s, over T + 1 = {BOUND} s: {run.stderr}"
    )
    assert "this job will compile cold" in run.stderr, run.stderr
    assert f"export TORCHINDUCTOR_CACHE_DIR={cache}" in run.stdout


@pytest.fixture
def fake_gpu_tools(tmp_path: Path) -> Path:
    """A folder holding an ``nvidia-smi`` that hangs and a ``pynvml`` whose init hangs."""
    folder = tmp_path / "fake-gpu"
    folder.mkdir()
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexec sleep 60\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    (folder / "pynvml.py").write_text(
        "import time\n"
        "class NVMLError(Exception):\n    pass\n"
        "def nvmlInit():\n    time.sleep(60)\n"
        "def nvmlShutdown():\n    pass\n"
    )
    return folder


def _archive_over_two_parts(tmp_path: Path) -> tuple[bytes, str]:
    """A real snapshot archive bigger than one ranged part (8 MiB): (bytes, snapshot id)."""
    src = tmp_path / "src"
    (src / "fxgraph" / "ab").mkdir(parents=True)
    (src / "fxgraph" / "ab" / "big").write_bytes(os.urandom(12 << 20))
    (src / "fxgraph" / "ab" / "small").write_bytes(b"small entry")
    store = LocalStore(home=tmp_path / "store")
    manifest = snapshot_dir(src, store=store, workload="wl", fingerprint=collect())
    out = tmp_path / "snap.tar.zst"
    write_archive(manifest, store.blobs, out, level=1)
    return out.read_bytes(), manifest.id


def _hit(snapshot_id: str, archive_url: str) -> dict[str, object]:
    summary = Summary(
        id=snapshot_id,
        workload="wl",
        fingerprint_digest="0" * 64,
        devices=("cpu",),
        verified=True,
        signed=False,
        size_bytes=12 << 20,
        file_count=2,
        created_at="2026-01-01T00:00:00.000000+00:00",
        last_used_at=None,
        pinned=False,
    )
    answer = ResolveAnswer(
        snapshot=summary, verified=True, exact=True, near_misses=(), archive_url=archive_url
    )
    return to_dict(answer)


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    made: list[FakeServer] = []
    yield made
    for server in made:
        server.close()


FAULTS = {
    "report_dribbles": "the report endpoint answers 1 byte a second",
    "resolve_dribbles": "the resolve answer comes 1 byte a second",
    "resolve_headers_dribble": "the resolve answer's status line and headers come 1 byte a second",
    "resolve_stalls": "the server reads the resolve and never answers",
    "resolve_is_1_gib": "the resolve answer is 1 GiB of JSON at full speed",
    "store_ranges_dribble": "the object store answers the archive's first 8 MiB, then 1 byte a second",
    "nvidia_smi_hangs": "an nvidia-smi on PATH that hangs",
    "nvml_hangs": "an NVML whose init hangs (a fake pynvml: no GPU driver here)",
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_prejob_ends_within_its_timeout_plus_one_second(
    fault: str, tmp_path: Path, servers: list[FakeServer], fake_gpu_tools: Path, reliability
) -> None:
    routes = {"/v1/resolve": answer_json(MISS), "/v1/reports": answer_json(STORED, status=201)}
    env = _env(tmp_path)
    if fault == "report_dribbles":
        routes["/v1/reports"] = dribble()
    elif fault == "resolve_dribbles":
        routes["/v1/resolve"] = dribble()
    elif fault == "resolve_headers_dribble":
        routes["/v1/resolve"] = dribble(headers_too=True)
    elif fault == "resolve_stalls":
        routes["/v1/resolve"] = stall()
    elif fault == "resolve_is_1_gib":
        routes["/v1/resolve"] = huge_json(size_bytes=1 << 30)
    elif fault == "store_ranges_dribble":
        data, snapshot_id = _archive_over_two_parts(tmp_path)
        store = FakeServer({"/bucket/": ranges(data, fast_until=8 << 20)})
        servers.append(store)
        routes["/v1/resolve"] = answer_json(_hit(snapshot_id, f"{store.url}/bucket/archive?sig=x"))
    elif fault == "nvidia_smi_hangs":
        env["PATH"] = f"{fake_gpu_tools}{os.pathsep}{env['PATH']}"
    elif fault == "nvml_hangs":
        env["PYTHONPATH"] = f"{fake_gpu_tools}{os.pathsep}{env['PYTHONPATH']}"
    server = FakeServer(routes)
    servers.append(server)
    run = _prejob(server, tmp_path, env)
    _assert_cold_in_time(run, tmp_path / "cache")
    if fault == "resolve_is_1_gib":
        assert run.max_rss_mb < 200, f"the hook held {run.max_rss_mb:.0f} MB of a 1 GiB answer"
        rss = f", peak RSS {run.max_rss_mb:.0f} MB"
    else:
        rss = ""
    if fault in ("nvidia_smi_hangs", "nvml_hangs"):
        assert "fingerprint" in run.stderr, run.stderr
    reliability.record(
        f"`prejob --timeout {T:g}`: {FAULTS[fault]}: cold, exit 0, ended in"
        f" {run.elapsed_s:.1f} s (bound T + 1 s){rss}",
        tries=1,
        outcome="kept",
        area="hook deadline",
    )


def test_postjob_ends_within_its_timeout_plus_one_second(
    tmp_path: Path, servers: list[FakeServer], fake_gpu_tools: Path, reliability
) -> None:
    cache = tmp_path / "cache"
    (cache / "fxgraph" / "ab" / "k").mkdir(parents=True)
    (cache / "fxgraph" / "ab" / "k" / "entry").write_bytes(b"compiled by the job")
    server = FakeServer({"/v1/reports": dribble()})
    servers.append(server)
    for case, env in (
        ("the report endpoint answers 1 byte a second", _env(tmp_path)),
        (
            "an nvidia-smi on PATH that hangs",
            {**_env(tmp_path), "PATH": f"{fake_gpu_tools}{os.pathsep}{os.environ['PATH']}"},
        ),
    ):
        run = _run(_hook("postjob", server, cache), env, tmp_path)
        assert run.returncode == 0, run.stderr
        assert run.elapsed_s <= BOUND, f"{case}: took {run.elapsed_s:.2f} s: {run.stderr}"
        reliability.record(
            f"`postjob --timeout {T:g}`: {case}: exit 0, ended in {run.elapsed_s:.1f} s (bound T + 1 s)",
            tries=1,
            outcome="kept",
            area="hook deadline",
        )


def _unshare_user() -> list[str] | None:
    """``unshare --user`` (root without its capabilities: a 0555 dir is then read-only to
    it), when this host allows user namespaces."""
    if os.geteuid() != 0:
        return []
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "--user", "true"], capture_output=True, timeout=30)
    return ["unshare", "--user"] if probe.returncode == 0 else None


def test_an_unusable_cache_dir_is_cold_and_never_exported(tmp_path: Path, reliability) -> None:
    """A --cache-dir that is a file, or a dir the hook cannot write: exit 0, one cold line
    naming the dir and why, and no TORCHINDUCTOR_CACHE_DIR export (a job given an
    unwritable cache dir crashes; torch's default is better than that)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    cases = [("a file", a_file, [])]
    prefix = _unshare_user()
    if prefix is not None:
        locked = tmp_path / "read-only"
        locked.mkdir()
        locked.chmod(0o555)
        cases.append(("a dir it cannot write", locked, prefix))
    for what, target, wrap in cases:
        proc = subprocess.run(
            [
                *wrap,
                sys.executable,
                "-m",
                "cachekeeper",
                "prejob",
                "--workload",
                "wl",
                "--cache-dir",
                str(target),
                "--timeout",
                str(T),
            ],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, (what, proc.stderr)
        assert "TORCHINDUCTOR_CACHE_DIR" not in proc.stdout, (what, proc.stdout)
        cold = [line for line in proc.stderr.splitlines() if "compile cold" in line]
        assert len(cold) == 1 and str(target) in cold[0] and "not exported" in cold[0], (
            what,
            proc.stderr,
        )
        assert a_file.read_text() == "not a folder"
        reliability.record(
            f"`prejob --cache-dir` naming {what}: exit 0, one cold line naming it, no export",
            tries=1,
            outcome="refused",
            area="hook deadline",
        )
    if prefix is None:
        pytest.skip("no user namespaces here: only the file case ran")
