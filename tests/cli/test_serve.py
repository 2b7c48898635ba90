"""``cachekeeper serve``'s start line, from real ``serve`` processes (issue 31): the URL it
serves (never a repr of its settings), and no token in any line it logs while starting,
whichever way the tokens came (a flag, the environment, a config file).
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.ports import free_port
from tests.helpers.tls import make_pki

CK = str(Path(sys.executable).parent / "cachekeeper")
FLAG_TOKEN = "flag-" + "x7" * 12
ENV_TOKEN = "env-" + "q9" * 12
FILE_TOKEN = "file-" + "z4" * 12

pytestmark = pytest.mark.slow  # serve processes


def _serve(tmp_path: Path, *args: str, host: str = "127.0.0.1", https: bool = False) -> list[str]:
    """Start ``serve``, wait until it answers /healthz, stop it; the lines of its stderr."""
    port = free_port()
    config = tmp_path / "server.toml"
    config.write_text(f'tokens = {{ "{FILE_TOKEN}" = "read" }}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKEEPER_")}
    env.update(CACHEKEEPER_HOME=str(tmp_path / "home"), CACHEKEEPER_TOKENS=f"{ENV_TOKEN}:admin")
    proc = subprocess.Popen(
        [CK, "serve", "--host", host, "--port", str(port), "--data", str(tmp_path / "data"),
         "--config", str(config), "--token", f"{FLAG_TOKEN}:write", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    scheme = "https" if https else "http"
    verify: ssl.SSLContext | bool = False
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                url = f"{scheme}://127.0.0.1:{port}/healthz"
                if httpx.get(url, verify=verify, timeout=1).is_success:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    for token in (FLAG_TOKEN, ENV_TOKEN, FILE_TOKEN):
        assert token not in out + err, "a token in the server's start-up output"
    assert "Settings(" not in err and "bound method" not in err, err
    return err.splitlines()


def test_the_start_line_names_the_url_and_no_token(tmp_path: Path) -> None:
    lines = _serve(tmp_path)
    data = tmp_path / "data"
    started = [line for line in lines if line.startswith("cachekeeper server on")]
    assert len(started) == 1, lines
    port = started[0].split(":")[2].split(" ")[0]
    assert started[0] == (
        f"cachekeeper server on http://127.0.0.1:{port} (data {data}, blobs {data / 'blobs'},"
        " auth on)"
    )
    assert not any("clear text" in line for line in lines)  # loopback: no warning


def test_the_start_line_says_https_with_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    lines = _serve(tmp_path, "--tls-cert", str(pki.cert), "--tls-key", str(pki.key), https=True)
    started = [line for line in lines if line.startswith("cachekeeper server on")]
    assert len(started) == 1 and started[0].startswith("cachekeeper server on https://127.0.0.1:")


def test_tokens_over_http_on_another_address_are_warned_about(tmp_path: Path) -> None:
    lines = _serve(tmp_path, host="0.0.0.0")
    assert any(line.startswith("cachekeeper server on http://0.0.0.0:") for line in lines)
    assert any(
        line.startswith("warning: bearer tokens travel in clear text over http") for line in lines
    ), lines
