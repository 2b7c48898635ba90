"""Transport security (issue 25): ``cachekeeper serve --tls-cert/--tls-key`` as a real
process, and every client path over https with a private CA (``--ca-bundle``,
``CACHEKEEPER_CA_BUNDLE``, ``SSL_CERT_FILE``): an operator command, push, the hook's
stdlib quick path and its report, and /metrics behind the read scope.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.caches import make_cache
from tests.helpers.ports import free_port
from tests.helpers.tls import Pki, make_pki

CK = str(Path(sys.executable).parent / "cachekeeper")

pytestmark = pytest.mark.slow  # a private CA, serve processes over https


def ck(*args: str, home: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_", "SSL_CERT"))}  # fmt: skip
    env.update(CACHEKEEPER_HOME=str(home), **extra)
    return subprocess.run([CK, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def https_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[str]:
    root = tmp_path_factory.mktemp("tls-server")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKEEPER_")}
    proc = subprocess.Popen(
        [CK, "serve", "--port", str(port), "--data", str(root / "data"),
         "--token", "w-tok:write", "--token", "r-tok:read",
         "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(
                    f"{url}/healthz", verify=ssl.create_default_context(cafile=pki.ca), timeout=1
                ).is_success:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_every_client_path_works_over_https_with_the_sites_ca(
    https_server: str, pki: Pki, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    ca = {"CACHEKEEPER_CA_BUNDLE": str(pki.ca)}
    listed = ck("snapshots", "ls", "--server", https_server, "--token", "r-tok",
                "--ca-bundle", str(pki.ca), "--json", home=home)  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == {"snapshots": []}
    untrusted = ck("snapshots", "ls", "--server", https_server, "--token", "r-tok", home=home)
    assert untrusted.returncode == 1 and "Traceback" not in untrusted.stderr
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr, untrusted.stderr
    replaced = ck("snapshots", "ls", "--server", https_server, "--token", "r-tok", home=home,
                  SSL_CERT_FILE=str(pki.ca))  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr

    src = tmp_path / "src"
    make_cache(src)
    pushed = ck("push", str(src), "--workload", "w", "--allow-unregistered", "--json",
                "--server", https_server, "--token", "w-tok", home=home, **ca)  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    snapshot_id = json.loads(pushed.stdout)["snapshot_id"]
    cache = tmp_path / "cache"
    for outcome in ("restored", "already_restored"):  # the second: the stdlib quick path
        hook = ck("prejob", "--workload", "w", "--cache-dir", str(cache), "--json",
                  "--server", https_server, "--token", "r-tok", home=home, **ca)  # fmt: skip
        report = json.loads(hook.stdout)
        assert (report["outcome"], report["snapshot_id"]) == (outcome, snapshot_id), hook.stderr
        assert report["reported"], report
    cold = ck("prejob", "--workload", "w", "--cache-dir", str(tmp_path / "c2"), "--server",
              https_server, "--token", "r-tok", home=home)  # fmt: skip
    assert cold.returncode == 0 and "CERTIFICATE_VERIFY_FAILED" in cold.stderr, cold.stderr
    bad_ca = ck("prejob", "--workload", "w", "--cache-dir", str(tmp_path / "c3"), "--server",
                https_server, home=home, CACHEKEEPER_CA_BUNDLE=str(tmp_path / "no.pem"))  # fmt: skip
    assert bad_ca.returncode == 0 and "no.pem" in bad_ca.stderr, bad_ca.stderr  # never fails

    with httpx.Client(base_url=https_server, verify=ssl.create_default_context(cafile=pki.ca)) as c:
        assert c.get("/metrics").status_code == 401
        scraped = c.get("/metrics", headers={"Authorization": "Bearer r-tok"})
        assert scraped.status_code == 200 and "cachekeeper_job_reports_total" in scraped.text


def test_serve_refuses_a_certificate_without_its_key(pki: Pki, tmp_path: Path) -> None:
    half = ck("serve", "--data", str(tmp_path / "d"), "--tls-cert", str(pki.cert), home=tmp_path)
    assert half.returncode == 2 and "tls_key" in half.stderr, half.stderr  # ConfigInvalid
    wrong = ck("serve", "--data", str(tmp_path / "d"), "--tls-cert", str(pki.cert),
               "--tls-key", str(pki.ca), home=tmp_path)  # fmt: skip
    assert wrong.returncode == 2 and "cannot load the TLS certificate" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
