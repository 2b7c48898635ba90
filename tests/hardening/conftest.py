"""Shared pieces of the hardening tests: the reliability log, real processes, a cache tree.

Each test records what it tried with ``reliability.record(fault, tries=N, outcome=...)``
once its assertions passed; ``scripts/reliability_report.py`` sets
``CACHEKEEPER_RELIABILITY_LOG`` to a JSON-lines file and turns the rows into the table in
docs/reliability.md. Without the variable, nothing is written.

Outcomes: ``kept`` (the fault happened and what was there stayed intact, nothing partial
appeared), ``refused`` (bad input answered with a clear error and nothing written),
``recovered`` (after the fault, a rerun completed).
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from bench.synthetic_cache import make_synthetic_cache
from tests.helpers.ports import free_port

REPO = Path(__file__).resolve().parents[2]
OUTCOMES = ("kept", "refused", "recovered")


@dataclass
class Reliability:
    test: str
    rows: list[dict[str, object]] = field(default_factory=list)

    def record(self, fault: str, *, tries: int, outcome: str, area: str) -> None:
        assert outcome in OUTCOMES, outcome
        row = {"area": area, "fault": fault, "tries": tries, "outcome": outcome, "test": self.test}
        self.rows.append(row)
        log = os.environ.get("CACHEKEEPER_RELIABILITY_LOG")
        if log:
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Reliability:
    return Reliability(test=request.node.nodeid)


def cli(*args: str, env: dict[str, str] | None = None) -> list[str]:
    return [sys.executable, "-m", "cachekeeper", *args]


def child_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKEEPER_")}
    env.update(CACHEKEEPER_HOME=str(home), PYTHONPATH=str(REPO), **extra)
    if "CACHEKEEPER_RELIABILITY_LOG" in os.environ:
        pass  # children never write the log; only the test process does
    return env


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def visible_files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` outside cachekeeper's own dot folder."""
    out: dict[str, bytes] = {}
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".cachekeeper") or path.is_dir():
            continue
        out[rel] = path.read_bytes()
    return out


def tree_of(root: Path) -> dict[str, bytes]:
    return visible_files(root)


@pytest.fixture(scope="session")
def cache_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic Inductor-like cache of a few hundred files (read-only for tests)."""
    root = tmp_path_factory.mktemp("synthetic") / "cache"
    make_synthetic_cache(root, size_mb=24, seed=7)
    return root


@dataclass
class ServerProcess:
    """``cachekeeper serve`` as a child process, so that it can be SIGKILLed."""

    data_dir: Path
    home: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"  # what it binds; it is probed on loopback
    args: tuple[str, ...] = ()  # more ``serve`` options (--config, --insecure-no-auth, ...)
    env: dict[str, str] = field(default_factory=dict)  # more variables for the server
    nofile: int | None = None  # the server's open-file limit (soft and hard), when set

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, timeout_s: float = 30.0) -> ServerProcess:
        """Start (or restart, on the same port and data dir) and wait for /healthz."""
        self.port = self.port or free_port()
        self.proc = subprocess.Popen(
            cli(
                "serve",
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--data",
                str(self.data_dir),
                *self.args,
            ),
            env=child_env(self.home, CACHEKEEPER_LOG_LEVEL="warning", **self.env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=None if self.nofile is None else self._limit_files,  # noqa: PLW1509
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cachekeeper serve exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("cachekeeper serve did not start")

    def _limit_files(self) -> None:
        import resource

        assert self.nofile is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[ServerProcess]:
    handle = ServerProcess(data_dir=tmp_path / "server-data", home=tmp_path / "server-home")
    try:
        yield handle
    finally:
        handle.kill()
