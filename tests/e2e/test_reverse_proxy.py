"""The reverse-proxy setup of docs/server.md, taken from the doc and run (issue 25).

nginx terminates TLS with the doc's ``server`` block (only its port, names and
certificate paths replaced) in front of a real ``cachekeeper serve`` on loopback; push,
the hook (its stdlib quick path and its report) and an operator command go through it
with the site's CA. Skipped where nginx is not installed (``apt-get install nginx-light``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.caches import make_cache
from tests.helpers.ports import free_port
from tests.helpers.tls import make_pki

REPO = Path(__file__).resolve().parents[2]
CK = str(Path(sys.executable).parent / "cachekeeper")
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)

pytestmark = [
    pytest.mark.slow,  # runs nginx in front of a server
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed"),
]


def doc_server_block() -> str:
    text = (REPO / "docs" / "server.md").read_text()
    section = text.split("## TLS: never send a token over plain http", 1)[1]
    (block,) = re.findall(r"```nginx\n(.*?)```", section, re.S)[:1]
    return re.sub(r"(?m)^  ", "", block)  # the block is indented in a list item


def wait_for(url: str, context: ssl.SSLContext | None, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/healthz", verify=context or False, timeout=1).is_success:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "did not start"
        time.sleep(0.1)


def test_the_documented_nginx_block_carries_every_client_path(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    backend, front = free_port(), free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_", "SSL_CERT"))}  # fmt: skip
    server = subprocess.Popen(
        [CK, "serve", "--port", str(backend), "--data", str(tmp_path / "data"),
         "--token", "w-tok:write", "--token", "r-tok:read"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    block = (
        doc_server_block()
        .replace("listen 443 ssl;", f"listen 127.0.0.1:{front} ssl;")
        .replace("server_name cache.example.com;", "server_name 127.0.0.1;")
        .replace("/etc/ssl/cache.example.com.pem", str(pki.cert))
        .replace("/etc/ssl/cache.example.com.key", str(pki.key))
        .replace("http://127.0.0.1:8750", f"http://127.0.0.1:{backend}")
    )
    temp = tmp_path / "nginx"
    temp.mkdir()
    conf = temp / "nginx.conf"
    head = f"worker_processes 1;\npid {temp}/nginx.pid;\nerror_log {temp}/error.log;\n"
    if os.geteuid() == 0:
        head += "user root;\n"  # workers read the test's temp files
    temps = "".join(
        f"  {kind}_temp_path {temp}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf.write_text(f"{head}events {{}}\nhttp {{\n  access_log off;\n{temps}{block}\n}}\n")
    proxy = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(temp), "-g", "daemon off;"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"https://127.0.0.1:{front}"
    try:
        wait_for(f"http://127.0.0.1:{backend}", None, server)
        wait_for(url, ssl.create_default_context(cafile=pki.ca), proxy)
        run_env = {**env, "CACHEKEEPER_HOME": str(tmp_path / "home"),
                   "CACHEKEEPER_CA_BUNDLE": str(pki.ca), "CACHEKEEPER_SERVER": url}  # fmt: skip

        def ck(*args: str, token: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([CK, *args, "--token", token], env=run_env,
                                  capture_output=True, text=True, timeout=120)  # fmt: skip

        src = tmp_path / "src"
        make_cache(src)  # one blob of 3 MiB: streamed through the proxy both ways
        pushed = ck("push", str(src), "--workload", "w", "--allow-unregistered", "--json",
                    token="w-tok")  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        snapshot_id = json.loads(pushed.stdout)["snapshot_id"]
        for outcome in ("restored", "already_restored"):
            hook = ck("prejob", "--workload", "w", "--cache-dir", str(tmp_path / "c"), "--json",
                      token="r-tok")  # fmt: skip
            report = json.loads(hook.stdout)
            assert (report["outcome"], report["snapshot_id"]) == (outcome, snapshot_id), hook.stderr
            assert report["reported"], report
        listed = ck("snapshots", "ls", "--json", token="r-tok")
        assert [s["id"] for s in json.loads(listed.stdout)["snapshots"]] == [snapshot_id]
    finally:
        proxy.terminate()
        server.terminate()
        proxy.wait(timeout=10)
        server.wait(timeout=10)
