"""Tokens never cross in clear on the per-key tier (issue 30): with ``--tls-cert`` the RESP
port speaks TLS with the HTTP port's certificate (redis-py's ``rediss://``, and prejob's
probe), cachekeeper's own backend reaches the tier over https with a site's private CA, and
prejob refuses a plain-text tier off this host unless told to."""

from __future__ import annotations

import hashlib
import importlib.util
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from cachekeeper import remote_tier
from cachekeeper.client.tier import probe, tier_exports
from cachekeeper.server.app import create_app
from cachekeeper.server.settings import Settings
from cachekeeper.wire import RemoteCacheOffer
from tests.conftest import REPO
from tests.helpers.ports import free_port
from tests.helpers.redis_py import redis_py_env, redis_py_versions
from tests.helpers.tls import Pki, make_pki

TOKENS = {"node-write": "write"}


@pytest.fixture(scope="module")
def tls_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Pki]]:
    """A real server over https on 127.0.0.1 with its RESP port (TLS too)."""
    root = tmp_path_factory.mktemp("tier-tls")
    pki = make_pki(root / "pki")
    settings = Settings(data_dir=root / "data", tokens=TOKENS, resp_port=0,
                        tls_cert=pki.cert, tls_key=pki.key)  # fmt: skip
    app = create_app(settings)
    resp_port = app.state.resp.start()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            ssl_certfile=str(pki.cert), ssl_keyfile=str(pki.key))  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        threading.Event().wait(0.05)
    try:
        yield f"https://127.0.0.1:{port}", resp_port, pki
    finally:
        server.should_exit = True
        thread.join(10)
        app.state.resp.stop(timeout_s=2)


def test_the_resp_port_speaks_tls_and_nothing_in_clear(
    tls_tier: tuple[str, int, Pki], monkeypatch: pytest.MonkeyPatch
) -> None:
    _url, resp_port, pki = tls_tier
    monkeypatch.setenv("CACHEKEEPER_CA_BUNDLE", str(pki.ca))
    assert probe("127.0.0.1", resp_port, token="node-write", tls=True) is None
    # in clear, the port answers nothing a Redis client reads as a reply
    with socket.create_connection(("127.0.0.1", resp_port), timeout=2) as sock:
        sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$10\r\nnode-write\r\n")
        try:
            got = sock.recv(64)
        except (ConnectionResetError, TimeoutError):
            got = b""
    assert not got.startswith(b"+OK")


def test_redis_py_reaches_the_tier_with_rediss_and_the_sites_ca(
    tls_tier: tuple[str, int, Pki],
) -> None:
    url, resp_port, pki = tls_tier
    tier_url = remote_tier.tier_url(url, port=resp_port, token="node-write", tls=True,
                                    ca_bundle=str(pki.ca))  # fmt: skip
    assert tier_url.startswith("rediss://")
    code = f"import redis; r = redis.Redis.from_url({tier_url!r}); print(r.ping())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**redis_py_env(redis_py_versions()[-1])}, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]


def _backend():
    path = REPO / "cachekeeper" / "_tier_hook" / "_cachekeeper_tier.py"
    spec = importlib.util.spec_from_file_location("_ck_tier_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cachekeepers_backend_puts_and_gets_over_https_with_the_sites_ca(
    tls_tier: tuple[str, int, Pki], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _resp_port, pki = tls_tier
    monkeypatch.setenv("CACHEKEEPER_CA_BUNDLE", str(pki.ca))
    backend = _backend()
    client = backend.Client(url=url, token="node-write", environment="0123456789ab",
                            writes=True, timeout_s=10.0, stats=backend.Stats("cachekeeper"))  # fmt: skip
    value = b"an FX graph entry " * 1000
    assert client.get("pt2:fx-graph-v1::tls-test:c1") is None
    assert client.put("pt2:fx-graph-v1::tls-test:c1", value) == "stored"
    got = client.get("pt2:fx-graph-v1::tls-test:c1")
    assert got is not None and hashlib.sha256(got).digest() == hashlib.sha256(value).digest()


def test_prejob_keeps_a_token_off_plain_text_to_another_host(tmp_path: Path) -> None:
    offer = RemoteCacheOffer(port=6380, use=True, writable=True, http=True,
                             switches=remote_tier.site_switches(tier=True))  # fmt: skip
    for backend in ("cachekeeper", "redis"):
        refused = tier_exports(offer, server="http://cache.example:8750", token="t", wish="on",
                               client_name="n", backend=backend,
                               environ={"CACHEKEEPER_HOME": str(tmp_path)})  # fmt: skip
        assert not refused.used and "in clear" in (refused.reason or ""), refused
        assert "--allow-plaintext" in (refused.reason or "")
        assert not any("t" == v or ":t@" in v for v in refused.exports.values())
    allowed = tier_exports(offer, server="http://cache.example:8750", token="t", wish="on",
                           client_name="n", backend="cachekeeper", allow_plaintext=True,
                           environ={"CACHEKEEPER_HOME": str(tmp_path)})  # fmt: skip
    assert allowed.used and allowed.backend == "cachekeeper"
