"""What a client says when TLS is wrong, and the plaintext rule (issue 31, transport errors),
the way a site meets them: ``cachekeeper`` processes against a real server with TLS on
loopback (a private CA), and against a listener on this host's non-loopback address that
counts every connection, so that "nothing was sent" is a measured zero.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.calls import refuse_plaintext
from cachekeeper.client.transport import post_json
from cachekeeper.errors import PlaintextRefused, ServerUnavailable
from cachekeeper.server.settings import Settings
from tests.helpers.caches import make_cache
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.slow_servers import FakeServer, answer_json
from tests.helpers.tls import Pki, make_pki

CK = str(Path(sys.executable).parent / "cachekeeper")
TOKEN = "tok-" + "s3cr3t" * 4


def ck(*args: str, home: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_", "SSL_CERT"))}  # fmt: skip
    env.update(CACHEKEEPER_HOME=str(home), **extra)
    return subprocess.run([CK, *args], capture_output=True, text=True, env=env, timeout=120)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("tls-server")
    settings = Settings(data_dir=data, tokens={TOKEN: "write"}, tls_cert=pki.cert, tls_key=pki.key)
    with start_server(settings) as handle:
        assert handle.url.startswith("https://")
        yield handle


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with start_server(Settings(data_dir=tmp_path_factory.mktemp("plain"))) as handle:
        yield handle


def _outward_address() -> str | None:
    """This host's address on a non-loopback interface (no packet is sent to learn it)."""
    for remote in ("198.51.100.1", "10.255.255.254"):  # a route is chosen, nothing is sent
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((remote, 9))
            except OSError:
                continue
            address = probe.getsockname()[0]
        if not address.startswith("127.") and address != "0.0.0.0":
            return address
    return None


@pytest.fixture
def outward() -> Iterator[tuple[str, FakeServer]]:
    """A listener on every address, reached by this host's non-loopback address:
    (its http:// URL, the server that counts connections and keeps each request)."""
    address = _outward_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    with FakeServer({"/": answer_json({"snapshots": []})}, host="0.0.0.0") as server:
        yield f"http://{address}:{server.port}", server


# -- TLS told apart from a dead server --------------------------------------------------


def test_the_client_tells_tls_apart_from_a_dead_server(tls_server: LiveServer) -> None:
    plain = tls_server.url.replace("https://", "http://")
    with CacheClient(base_url=plain, timeout_s=5, retries=0) as client:
        with pytest.raises(ServerUnavailable, match=f"speaks TLS: use {tls_server.url}"):
            client.health()
    with CacheClient(base_url=tls_server.url, timeout_s=5, retries=0) as client:
        with pytest.raises(ServerUnavailable, match="CERTIFICATE_VERIFY_FAILED.*--ca-bundle"):
            client.health()


@pytest.mark.slow  # a cachekeeper process
def test_http_to_a_tls_server_says_use_https(tls_server: LiveServer, tmp_path: Path) -> None:
    plain = tls_server.url.replace("https://", "http://")
    proc = ck("snapshots", "ls", "--server", plain, "--token", TOKEN, "--timeout", "20",
              home=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    line = one_line(proc)
    assert f"speaks TLS: use {tls_server.url}" in line, line
    assert line.endswith("[server_unavailable]")
    assert TOKEN not in proc.stderr


@pytest.mark.slow  # a cachekeeper process
def test_an_untrusted_certificate_names_ca_bundle(tls_server: LiveServer, tmp_path: Path) -> None:
    proc = ck("snapshots", "ls", "--server", tls_server.url, "--token", TOKEN, home=tmp_path)
    assert proc.returncode != 0
    line = one_line(proc)
    assert "CERTIFICATE_VERIFY_FAILED" in line and "--ca-bundle" in line, line


def test_https_to_a_plain_server_says_use_http(plain_server: LiveServer) -> None:
    tls = plain_server.url.replace("http://", "https://")
    with CacheClient(base_url=tls, timeout_s=5, retries=0) as client:
        with pytest.raises(ServerUnavailable, match="does not speak TLS: use http://"):
            client.health()


def test_a_server_that_is_down_gets_no_tls_advice() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"  # bound, never listening
        with CacheClient(base_url=url, timeout_s=2, retries=0) as client:
            with pytest.raises(ServerUnavailable) as refused:
                client.health()
    assert "TLS" not in refused.value.detail and "--ca-bundle" not in refused.value.detail


# -- the plaintext rule --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "token", "refused"),
    [
        ("http://cache.example:8750", "t", True),
        ("http://10.1.2.3:8750/v1", "t", True),
        ("http://user:pw@cache.example:8750", None, True),  # a password is a credential too
        ("http://cache.example:8750", None, False),  # anonymous: nothing to leak
        ("https://cache.example:8750", "t", False),
        ("http://127.0.0.1:8750", "t", False),
        ("http://127.8.9.10:8750", "t", False),
        ("http://localhost:8750", "t", False),
        ("http://[::1]:8750", "t", False),
    ],
)
def test_refuse_plaintext(url: str, token: str | None, refused: bool) -> None:
    if not refused:
        refuse_plaintext(url, token=token, allow=False)
        return
    with pytest.raises(PlaintextRefused, match=r"use https:// or --allow-plaintext") as exc:
        refuse_plaintext(url, token=token, allow=False)
    assert ":pw@" not in exc.value.detail  # the message never shows the password
    assert f"{urlsplit(url).hostname} is not a loopback address" in exc.value.detail
    refuse_plaintext(url, token=token, allow=True)


@pytest.mark.slow  # eight cachekeeper processes
def test_no_client_path_sends_the_token_in_clear_to_another_host(
    outward: tuple[str, FakeServer], tmp_path: Path
) -> None:
    url, server = outward
    cache = tmp_path / "cache"
    make_cache(cache)
    pushed = ck("push", str(cache), "--workload", "w", "--server", url, "--token", TOKEN,
                home=tmp_path / "home")  # fmt: skip
    assert pushed.returncode == 2, pushed.stderr
    line = one_line(pushed)
    assert line.startswith(f"error: refusing to send the bearer token to {url} in clear text")
    assert line.endswith("use https:// or --allow-plaintext (CACHEKEEPER_ALLOW_PLAINTEXT=1)"
                         " [plaintext_refused]"), line  # fmt: skip
    with pytest.raises(PlaintextRefused):
        CacheClient(base_url=url, token=TOKEN)
    assert post_json(url, "/v1/resolve", {}, token=TOKEN, timeout_s=5) is None

    # the hook: a cold start in one line, the job still gets its exports; --strict fails
    hook = ck("prejob", "--workload", "w", "--cache-dir", str(tmp_path / "c"),
              "--server", url, "--token", TOKEN, home=tmp_path / "home")  # fmt: skip
    assert hook.returncode == 0, hook.stderr
    assert hook.stdout == f"export TORCHINDUCTOR_CACHE_DIR={tmp_path / 'c'}\n"
    assert "plaintext_refused" in one_line(hook) and "--allow-plaintext" in hook.stderr
    strict = ck("prejob", "--workload", "w", "--cache-dir", str(tmp_path / "c"), "--strict",
                "--server", url, "--token", TOKEN, home=tmp_path / "home")  # fmt: skip
    assert strict.returncode != 0
    after = ck("postjob", "--workload", "w", "--cache-dir", str(tmp_path / "c"),
               "--server", url, "--token", TOKEN, home=tmp_path / "home")  # fmt: skip
    assert after.returncode == 0, after.stderr
    assert "not reported: refusing to send the bearer token" in after.stderr
    assert server.connections == 0  # not one connection: the token never left this host

    # what it stopped: the same command allowed sends the token to that host
    allowed = ck("snapshots", "ls", "--server", url, "--token", TOKEN, "--allow-plaintext",
                 "--json", home=tmp_path / "home")  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    by_env = ck("snapshots", "ls", "--server", url, "--token", TOKEN, "--json",
                home=tmp_path / "home", CACHEKEEPER_ALLOW_PLAINTEXT="1")  # fmt: skip
    assert by_env.returncode == 0, by_env.stderr
    assert [r.headers.get("authorization") for r in server.requests] == [f"Bearer {TOKEN}"] * 2
    anonymous = ck("snapshots", "ls", "--server", url, "--json", home=tmp_path / "home")
    assert anonymous.returncode == 0, anonymous.stderr  # no token: nothing to refuse
