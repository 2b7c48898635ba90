"""Fixtures for the server tests: a real uvicorn server on 127.0.0.1 with a fresh data dir
(``live``, ``client``, ``fresh_server``), or the real app in this process without a socket
(``in_process_server``, ``api``: tests/helpers/in_process.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachekeeper.manifest import FileEntry, Manifest
from cachekeeper.server.settings import Settings
from tests.helpers.in_process import InProcessServer, in_process
from tests.helpers.live_server import LiveServer, start_server

FINGERPRINT: dict[str, Any] = {
    "schema": 1,
    "torch": "2.13.0+cpu",
    "triton": None,
    "cuda": None,
    "cuda_wheels": {},
    "driver": "580.10",
    "gpus": [{"index": 0, "name": "NVIDIA H200", "capability": "9.0"}],
    "python": "3.11",
    "arch": "x86_64",
    "env": {},
}


def workload_toml(name: str) -> str:
    """The smallest valid workload file named ``name`` (one CPU-sized attention regime)."""
    return (
        f'name = "{name}"\n[[attention]]\nbatch = 1\nq_heads = 2\nhead_dim = 16\n'
        'seq_lens = [128]\ndtype = "float32"\n'
    )


def make_snapshot(
    files: dict[str, bytes],
    *,
    workload: str | None = "wl",
    fingerprint: dict[str, Any] | None = None,
    devices: tuple[str, ...] = ("cuda:0",),
    verified: bool | None = None,
) -> tuple[Manifest, dict[str, bytes]]:
    """A manifest for ``files`` and its blobs {digest: bytes}."""
    blobs = {hashlib.sha256(data).hexdigest(): data for data in files.values()}
    entries = tuple(
        FileEntry(path=p, digest=hashlib.sha256(d).hexdigest(), size_bytes=len(d))
        for p, d in files.items()
    )
    stats = None if verified is None else {"verify": {"effective": verified}}
    manifest = Manifest(
        files=entries,
        fingerprint=dict(fingerprint or FINGERPRINT),
        devices=devices,
        workload=workload,
        stats=stats,
    )
    return manifest, blobs


def push(client: httpx.Client, manifest: Manifest, blobs: dict[str, bytes]) -> httpx.Response:
    """Upload every blob, then publish; returns the publish response."""
    for digest, data in blobs.items():
        r = client.put(f"/v1/blobs/{digest}", content=data)
        assert r.status_code in (200, 201), r.text
    return client.post("/v1/snapshots", content=manifest.to_json())


def random_files(n: int, *, size: int = 1000, seed: int = 0, prefix: str = "f") -> dict[str, bytes]:
    rng = __import__("random").Random(seed)
    return {f"{prefix}/{i:04d}.bin": rng.randbytes(size) for i in range(n)}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One open (no auth) server per test module, on its own data dir."""
    data = tmp_path_factory.mktemp("server-data")
    handle = start_server(Settings(data_dir=data, gc_grace_s=3600))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def client(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[Any]:
    """A factory of servers on per-test data dirs, all stopped at the end."""
    started: list[LiveServer] = []

    def make(**options: Any) -> LiveServer:
        options.setdefault("data_dir", tmp_path / "data")
        handle = start_server(Settings(**options))
        started.append(handle)
        return handle

    yield make
    for handle in started:
        handle.stop()


@pytest.fixture
def in_process_server(tmp_path: Path) -> Iterator[Callable[..., InProcessServer]]:
    """``in_process_server(**settings)``: a fresh app in this process on this test's data
    dir (tests/helpers/in_process.py); each is closed at the end."""
    with ExitStack() as opened:

        def make(**options: Any) -> InProcessServer:
            options.setdefault("data_dir", tmp_path / "data")
            return opened.enter_context(in_process(Settings(**options)))

        yield make


@pytest.fixture
def api(in_process_server: Callable[..., InProcessServer]) -> httpx.Client:
    """A client of a fresh in-process app with default settings."""
    return in_process_server().client
