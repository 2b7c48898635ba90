"""Session-wide fixtures shared by every test package.

Cold CPU compiles of flex_attention take ~25 s on the 2-core CI machine, so the suite
compiles as few distinct workloads as it can and shares them: ``compiled_cache`` is one
real Inductor cache dir, compiled once per session in a fresh process.

The real servers (uvicorn on loopback, tests/helpers/live_server.py) that tests in several
packages share: ``open_server`` (per test, no auth), ``authed_server`` (per module, with
``TOKENS``) and ``tiny_server`` (per module, with the cpu-tiny workload registered).

Markers (registered in pyproject.toml, ``--strict-markers``): ``compile`` (runs
torch.compile), ``slow`` (seconds or more each), ``hardening`` (tests/hardening/),
``browser`` (drives chromium), ``gpu``. ``pytest_collection_modifyitems`` below applies
the ones a test's place or fixtures imply, so a new test cannot forget them: every test
under tests/hardening/ is ``hardening``; one that uses ``compiled_cache`` (directly or
through another fixture) is ``compile``; one that uses the ``browser`` fixture is
``browser``; every ``compile`` test is ``slow`` too. Each test then gets the timeout of
its heaviest marker (``TIMEOUTS_S``) unless it sets its own ``timeout`` mark; the rest
get pyproject's default. ``./scripts/test-fast`` runs ``not slow and not hardening and
not browser``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cachekeeper.server.settings import Settings
from tests.helpers.live_server import TOKENS, LiveServer, start_server
from tests.helpers.moto_server import MotoServer, start_moto
from tests.helpers.redis_py import redis_py_versions
from tests.helpers.requires import require

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "tests" / "flex_probe.py"
TINY = REPO / "examples" / "workloads" / "cpu-tiny.toml"
HARDENING = REPO / "tests" / "hardening"

# Per-test timeouts by marker, heaviest first; the default (pyproject's ``timeout``) is for
# the rest. Measured on the 2-core dev VM under the load of four engineers: the slowest
# compile test took 110 s (a cold compile is ~25 s alone), the slowest hardening test
# 76 s, the slowest unmarked one 5 s; each bound is several times that.
TIMEOUTS_S = {"compile": 600, "hardening": 300, "slow": 300}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Apply the markers a test's place and fixtures imply, then its marker's timeout."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if HARDENING in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.hardening)
        if "compiled_cache" in fixtures:
            item.add_marker(pytest.mark.compile)
        if "browser" in fixtures:
            item.add_marker(pytest.mark.browser)
        if item.get_closest_marker("compile") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("timeout") is None:
            for name, seconds in TIMEOUTS_S.items():
                if item.get_closest_marker(name):
                    item.add_marker(pytest.mark.timeout(seconds))
                    break


def run_probe(cache_dir: Path, *, extra_env: dict[str, str] | None = None) -> dict:
    """Run tests/flex_probe.py in a fresh process on ``cache_dir``; return its counters."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), **(extra_env or {})}
    proc = subprocess.run(
        [sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def compiled_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Inductor cache dir holding one compiled CPU flex_attention (read-only use)."""
    require("torch")
    cache = tmp_path_factory.mktemp("compiled") / "inductor"
    counters = run_probe(cache)
    assert counters["inductor"].get("fxgraph_cache_miss", 0) >= 1, counters
    return cache


@pytest.fixture(scope="session")
def redis_py() -> list[str]:
    """The redis-py versions scripts/setup installs side by side (7.x and 8.x, oldest
    first). Without them a test fails, never skips: the tier's proof runs through both."""
    versions = redis_py_versions()
    if len(versions) < 2:
        pytest.fail(
            f"redis-py 7.x and 8.x are not both in .venv/redis-py (found {versions}):"
            " ./scripts/setup installs them",
            pytrace=False,
        )
    return versions


@pytest.fixture
def cache_copy(compiled_cache: Path, tmp_path: Path) -> Path:
    """A private copy of ``compiled_cache`` a test may modify."""
    dst = tmp_path / "cache-copy"
    shutil.copytree(compiled_cache, dst, symlinks=True)
    return dst


@pytest.fixture
def ck_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated CACHEKEEPER_HOME (local store) for one test."""
    home = tmp_path / "ck-home"
    monkeypatch.setenv("CACHEKEEPER_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoServer]:
    """One real S3 API server (moto) on loopback for the session, with AWS_* pointing at it.

    The variables are set in this process (the live server runs in a thread here) and so
    reach the CLI subprocesses too; they are restored when the session ends.
    """
    require("boto3")
    handle = start_moto()
    saved = {k: os.environ.get(k) for k in handle.env}
    os.environ.update(handle.env)
    try:
        yield handle
    finally:
        handle.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(moto_s3: MotoServer) -> str:
    """A fresh bucket on the session's moto server: its ``s3://BUCKET/PREFIX`` URL."""
    return moto_s3.new_bucket()


@pytest.fixture
def open_server(tmp_path: Path) -> Iterator[LiveServer]:
    """A real server (uvicorn on loopback, no auth) on this test's own data dir."""
    with start_server(Settings(data_dir=tmp_path / "data")) as handle:
        yield handle


@pytest.fixture(scope="module")
def authed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One real server per test module with auth on: ``live_server.TOKENS`` (write-token,
    read-token)."""
    data = tmp_path_factory.mktemp("server")
    with start_server(Settings(data_dir=data, tokens=TOKENS)) as handle:
        yield handle


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One real server per test module (no auth) with examples/workloads/cpu-tiny.toml
    registered as ``cpu-tiny``."""
    with start_server(Settings(data_dir=tmp_path_factory.mktemp("server"))) as handle:
        answer = httpx.put(f"{handle.url}/v1/workloads/cpu-tiny", content=TINY.read_bytes())
        assert answer.status_code == 200, answer.text
        yield handle
