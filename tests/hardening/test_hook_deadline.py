"""The hook's deadline is a promise (issue 24): ``prejob --timeout T`` and ``postjob
--timeout T`` end within T + 1 s under every fault, and never export an unusable dir.

Every fault is a real one, on one route of the real server (a relay in front of it,
``slow_servers.forward``, passes the others through): an answer trickled a byte a second,
a stall, a gigabyte of JSON, an object store (moto, behind a relay too) whose later
ranges of the server's own archive object trickle, an ``nvidia-smi`` on PATH that hangs. Only NVML is faked (a ``pynvml`` module
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
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.push import push
from cachekeeper.server.settings import Settings
from cachekeeper.store import LocalStore
from tests.hardening.conftest import child_env
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.moto_server import MotoServer
from tests.helpers.slow_servers import FakeServer, dribble, forward, huge_json, ranges, stall

T = 2.0  # the hook's --timeout in these tests
BOUND = T + 1.0  # the contract


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


def _big_cache(root: Path) -> Path:
    """A cache dir whose archive is bigger than one ranged part of the hook's (8 MiB)."""
    (root / "fxgraph" / "ab").mkdir(parents=True)
    (root / "fxgraph" / "ab" / "big").write_bytes(os.urandom(12 << 20))
    (root / "fxgraph" / "ab" / "small").write_bytes(b"small entry")
    return root


def _object_store_behind_a_relay(
    tmp_path: Path, moto_s3: MotoServer, stack: ExitStack, monkeypatch: pytest.MonkeyPatch
) -> tuple[LiveServer, FakeServer, str]:
    """A real server on a real object store (moto) that it reaches, and presigns URLs for,
    through a relay: (the server, the relay, the path prefix of its archive objects). The
    snapshot of ``_big_cache`` is pushed and packed; nodes are offered its archive URL."""
    bucket_url = moto_s3.new_bucket()
    relay = stack.enter_context(FakeServer({"/": forward(moto_s3.url)}))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", relay.url)  # read once, as the server opens
    live = stack.enter_context(
        start_server(Settings(data_dir=tmp_path / "data", blob_store=bucket_url))
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.url)
    src = _big_cache(tmp_path / "src")
    with CacheClient(base_url=live.url) as client:
        push(src, client=client, workload="wl", store=LocalStore(home=tmp_path / "store"))
    bucket, _, prefix = bucket_url.removeprefix("s3://").partition("/")
    return live, relay, f"/{bucket}/{prefix}/archives/"


def _archive_object(path_prefix: str) -> bytes:
    """The one archive object under ``path_prefix`` (``/BUCKET/KEY-PREFIX/``), read from
    the object store itself (``moto_s3`` points boto3 at it)."""
    bucket, _, prefix = path_prefix.strip("/").partition("/")
    s3 = boto3.session.Session().client("s3")
    (found,) = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")["Contents"]
    return bytes(s3.get_object(Bucket=bucket, Key=found["Key"])["Body"].read())


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    """Servers and relays a test starts, all stopped at its end."""
    with ExitStack() as opened:
        yield opened


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
    fault: str,
    tmp_path: Path,
    stack: ExitStack,
    fake_gpu_tools: Path,
    reliability,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real server answers, through a relay, every route the fault leaves alone: a
    miss for workload ``wl``, which nobody registered, and the job reports."""
    env = _env(tmp_path)
    if fault == "store_ranges_dribble":
        moto_s3 = request.getfixturevalue("moto_s3")
        live, store, archives = _object_store_behind_a_relay(tmp_path, moto_s3, stack, monkeypatch)
        data = _archive_object(archives)
        assert len(data) > 8 << 20  # two ranged parts: the second one dribbles
        store.routes[archives] = ranges(data, fast_until=8 << 20)
    else:
        live = stack.enter_context(start_server(Settings(data_dir=tmp_path / "data")))
    server = stack.enter_context(FakeServer({"/": forward(live.url)}))
    routes = server.routes
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
    elif fault == "nvidia_smi_hangs":
        env["PATH"] = f"{fake_gpu_tools}{os.pathsep}{env['PATH']}"
    elif fault == "nvml_hangs":
        env["PYTHONPATH"] = f"{fake_gpu_tools}{os.pathsep}{env['PYTHONPATH']}"
    run = _prejob(server, tmp_path, env)
    _assert_cold_in_time(run, tmp_path / "cache")
    # the fault was met, not missed: the hook asked the broken route
    faulted = {r: route for r, route in routes.items() if r != "/"}
    for path in faulted:
        assert any(r.path.startswith(path) for r in server.requests), (path, server.requests)
    if fault == "store_ranges_dribble":
        gets = [r for r in store.requests if r.method == "GET" and r.path.startswith(archives)]
        starts = [int(r.headers["range"].removeprefix("bytes=").split("-")[0]) for r in gets]
        assert 0 in starts and any(at >= 8 << 20 for at in starts), starts  # reached part 2
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
    tmp_path: Path, stack: ExitStack, fake_gpu_tools: Path, reliability
) -> None:
    cache = tmp_path / "cache"
    (cache / "fxgraph" / "ab" / "k").mkdir(parents=True)
    (cache / "fxgraph" / "ab" / "k" / "entry").write_bytes(b"compiled by the job")
    server = stack.enter_context(FakeServer({"/v1/reports": dribble()}))
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
