"""Slow clients (issue 24): 1,100 connections that send their headers a byte every 5 s,
unauthenticated, against a server whose open-file limit is 1,024 (the attack that took it
down). Header time is bounded, connections are capped below the file limit, and
``/healthz`` keeps answering all along. A real ``cachekeeper serve`` process with a real
1,024 file limit; real sockets."""

from __future__ import annotations

import resource
import socket
import threading
import time
from pathlib import Path

import httpx

from tests.hardening.conftest import ServerProcess

ATTACKERS = 1100
NOFILE = 1024
HEADER_TIMEOUT_S = 4.0


def test_slow_header_senders_never_take_the_server_down(tmp_path: Path, reliability) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < ATTACKERS + 200:  # this test process opens the attackers' sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    server = ServerProcess(
        data_dir=tmp_path / "data",
        home=tmp_path / "home",
        nofile=NOFILE,
        env={"CACHEKEEPER_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)},
    ).start()
    attackers: list[socket.socket] = []
    stop = threading.Event()
    try:
        for _ in range(ATTACKERS):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(b"G")
            attackers.append(sock)

        def trickle() -> None:  # a header byte every 5 s on each connection
            message = b"ET /healthz HTTP/1.1\r\nHost: x\r\n"
            for i in range(len(message)):
                if stop.wait(5.0):
                    return
                for sock in attackers:
                    try:
                        sock.send(message[i : i + 1])
                    except OSError:
                        pass

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        answered, slowest = 0, 0.0
        probes = 0
        until = time.monotonic() + 3 * HEADER_TIMEOUT_S
        while time.monotonic() < until:
            probes += 1
            started = time.monotonic()
            answer = httpx.get(f"{server.url}/healthz", timeout=5)
            assert answer.status_code == 200, answer.text
            answered += 1
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.25)
        assert server.proc is not None and server.proc.poll() is None  # still running
        closed = 0
        for sock in attackers:
            sock.settimeout(0.01)
            try:
                if sock.recv(1) == b"":
                    closed += 1
            except TimeoutError:
                pass
            except OSError:
                closed += 1
        assert closed == ATTACKERS, f"{ATTACKERS - closed} slow connections are still open"
    finally:
        stop.set()
        for sock in attackers:
            sock.close()
        server.kill()
    reliability.record(
        f"{ATTACKERS:,} unauthenticated connections sending headers a byte every 5 s, server"
        f" open-file limit {NOFILE:,}: /healthz answered all {answered} probes (slowest"
        f" {slowest * 1000:.0f} ms), every slow connection closed (header timeout"
        f" {HEADER_TIMEOUT_S:g} s, or evicted for newer ones at the cap)",
        tries=1,
        outcome="kept",
        area="bounded requests",
    )
