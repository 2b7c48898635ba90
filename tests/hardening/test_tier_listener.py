"""The tier's listener spends nothing much before auth (issue 32, class 5), measured for real.

The third independent attack found, unauthenticated: 8 stalled 128 MiB SETs held 1 GB (read
before auth, no frame timeout, in the process that serves the HTTP API); ``CLIENT SETINFO``
before auth grew memory without a cap; 1,100 idle connections took every descriptor and
``/healthz`` stopped answering, 1,024 locked real nodes out; ~11,000 token guesses a second
on one connection. With a token: 12 unread large GETs pinned 736 MB. On an auth-off laptop
server, an HTTP POST (which any web page can make a browser send) stored a value; and a SET
with a dropped or over-long ``EX`` killed its connection's task with a traceback.

Each reproducer runs against a real ``cachekeeper serve`` process (its resident memory and
descriptors read from /proc) or a real listener on loopback, with small budgets in the
server's settings where the logic is the same, and one realistic descriptor exhaustion
against a 1,024 open-file limit. The listener's bounds: server/resp/bounds.py.
"""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cachekeeper.server.resources.tier_keys import tier_key, tier_lru, tier_totals
from cachekeeper.server.settings import Settings
from tests.hardening.conftest import ServerProcess
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.ports import free_port
from tests.helpers.procfs import open_fds, rss_bytes
from tests.helpers.redis_py import redis_py_env, redis_py_versions
from tests.helpers.resp import closed, command, connect, replies, send_for

pytestmark = pytest.mark.usefixtures("redis_py")  # fails, never skips, without redis-py

TOKENS = {"node-write": "write", "node-read": "read"}
MiB = 1 << 20


@dataclass
class Served:
    """A real ``serve`` process and its tier's port."""

    process: ServerProcess
    resp_port: int

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def pid(self) -> int:
        assert self.process.proc is not None
        return self.process.proc.pid


def serve(tmp_path: Path, *, nofile: int | None = None, **settings: object) -> Served:
    """A real ``serve`` with the tier, auth on, and ``settings`` as CACHEKEEPER_* variables."""
    env = {"CACHEKEEPER_TOKENS": json.dumps(TOKENS)}
    env.update({f"CACHEKEEPER_{k.upper()}": str(v) for k, v in settings.items()})
    port = free_port()
    process = ServerProcess(
        data_dir=tmp_path / "server-data",
        home=tmp_path / "server-home",
        args=("--resp-port", str(port)),
        env=env,
        nofile=nofile,
    )
    return Served(process=process.start(), resp_port=port)


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Served]:
    handle = serve(tmp_path, **getattr(request, "param", {}))
    try:
        yield handle
    finally:
        handle.process.kill()


def metric(handle: Served | LiveServer, name: str, **labels: str) -> float:
    """A counter from the server's /metrics (a process) or its registry (in this process)."""
    if isinstance(handle, LiveServer):
        return float(handle.app.state.metrics.value(name, **labels))
    text = httpx.get(f"{handle.url}/metrics", headers={"Authorization": "Bearer node-read"}).text
    label = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    wanted = f"{name}{{{label}}} " if label else f"{name} "
    for line in text.splitlines():
        if line.startswith(wanted):
            return float(line.split()[-1])
    return 0.0


def authed(port: int, token: bytes = b"node-write", **kw: object) -> socket.socket:
    sock = connect(port, **kw)  # type: ignore[arg-type]
    sock.sendall(command(b"AUTH", token))
    assert replies(sock, 1) == [b"+OK"]
    return sock


def warm(handle: Served) -> int:
    """Touch both listeners once, then the server's resident bytes (the baseline)."""
    sock = authed(handle.resp_port)
    sock.sendall(command(b"PING"))
    assert replies(sock, 1) == [b"+PONG"]
    sock.close()
    assert httpx.get(f"{handle.url}/healthz").status_code == 200
    time.sleep(0.3)
    return rss_bytes(handle.pid)


def run_node(
    port: int, *, token: str = "node-write", key: str = "pt2:fx-graph-v1::node:c1"
) -> dict:
    """A real node: redis-py (the newest installed, as torch's backend uses it) SETs and GETs
    through the tier with prejob's URL options; what it saw, with timings."""
    url = f"redis://:{token}@127.0.0.1:{port}/0?socket_timeout=2&socket_connect_timeout=2"
    script = f"""
import json, time, redis
out = {{}}
started = time.monotonic()
try:
    r = redis.Redis.from_url({url!r})
    out['set'] = r.set({key!r}, b'value')
    for _ in range(100):
        got = r.get({key!r})
        if got is not None:
            break
        time.sleep(0.02)
    out['get'] = got.decode() if got else None
except Exception as exc:
    out['error'] = type(exc).__name__ + ': ' + str(exc)
out['seconds'] = time.monotonic() - started
print(json.dumps(out))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**__import__("os").environ, **redis_py_env(redis_py_versions()[-1])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class PeakFds:
    """The most descriptors ``pid`` held while this was running (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, open_fds(self.pid))

    def __enter__(self) -> PeakFds:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def raise_own_file_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, wanted), hard))


# -- an unauthenticated peer ------------------------------------------------------------


def test_an_unauthenticated_peer_cannot_make_the_server_hold_memory(
    server: Served, reliability
) -> None:
    """8 SETs declaring 128 MiB values, each sending 16 MiB and stalling, before any AUTH:
    refused at their bulk header (Redis's unauthenticated limit) and closed; then 500
    ``CLIENT SETINFO`` of 8 KiB each before auth: refused, one by one. The server's resident
    memory is read from /proc before and while the peers stall."""
    port = server.resp_port
    baseline = warm(server)
    header = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % (128 * MiB)
    stalled, answers = [], []
    sent = 0
    for _ in range(8):
        sock = connect(port)
        sock.sendall(header)
        answers.append(replies(sock, 1, timeout_s=1))
        sent += send_for(sock, b"x" * (16 * MiB), seconds=0.5)
        stalled.append(sock)
    time.sleep(0.5)
    grown_sets = rss_bytes(server.pid) - baseline
    assert all(a == [b"-ERR Protocol error: unauthenticated bulk length"] for a in answers), answers
    assert all(closed(sock, wait_s=2) for sock in stalled)
    assert grown_sets < 16 * MiB, f"the server grew {grown_sets / MiB:.0f} MiB"

    sock = connect(port)
    info = command(b"CLIENT", b"SETINFO", b"LIB-NAME", b"n" * (8 << 10))
    for _ in range(10):
        sock.sendall(info * 50)
        assert replies(sock, 50) == [b"-NOAUTH Authentication required."] * 50
    grown_info = rss_bytes(server.pid) - baseline
    assert grown_info < 16 * MiB, f"the server grew {grown_info / MiB:.0f} MiB"
    sock.close()
    reliability.record(
        f"unauthenticated: 8 SETs declaring 128 MiB that stall after {sent / MiB:.0f} MiB sent"
        f" in all; 500 CLIENT SETINFO of 8 KiB before auth: each refused at once (the SET"
        f" at its header, as Redis's unauthenticated bulk limit), the server's RSS"
        f" +{max(grown_sets, grown_info) / MiB:.1f} MiB (before: 1 GB held)",
        tries=508,
        outcome="refused",
        area="tier listener",
    )


@pytest.mark.parametrize(
    "server",
    [{"remote_cache_pending_bytes": "32MiB", "remote_cache_frame_timeout_s": 3}],
    indirect=True,
)
def test_stalled_sets_with_a_write_token_hold_only_the_writers_budget(
    server: Served, reliability
) -> None:
    """With a write token, 8 SETs declaring 24 MiB each send 20 MiB and stall: one value
    fits the writer's 32 MiB budget and is read, the others are read and dropped as they
    come; each stalled command is cut off by the frame timeout (3 s here), and its share
    of the budget comes back (a later SET is stored)."""
    port = server.resp_port
    baseline = warm(server)
    stalled = []
    for i in range(8):
        sock = authed(port)
        sock.sendall(b"*3\r\n$3\r\nSET\r\n$2\r\nk%d\r\n$%d\r\n" % (i, 24 * MiB))
        send_for(sock, b"v" * (20 * MiB), seconds=1.0)
        stalled.append(sock)
    time.sleep(0.3)
    grown = rss_bytes(server.pid) - baseline
    started = time.monotonic()
    assert all(closed(sock, wait_s=6) for sock in stalled)
    cut_after = time.monotonic() - started
    node = run_node(port)
    assert node.get("get") == "value", node
    assert grown < 64 * MiB, f"the server grew {grown / MiB:.0f} MiB"
    assert (
        metric(server, "cachekeeper_remote_cache_connections_closed_total", reason="frame_timeout")
        == 8
    )
    reliability.record(
        f"write token: 8 SETs declaring 24 MiB that stall after 20 MiB each: the server's RSS"
        f" +{grown / MiB:.0f} MiB (the writer's budget, 32 MiB here; before: every value"
        f" held), all 8 cut off by the frame timeout (3 s; the last {cut_after:.1f} s after"
        " the stalls), the budget back for the next SET",
        tries=8,
        outcome="kept",
        area="tier listener",
    )


@pytest.mark.parametrize(
    "server",
    [
        {
            "remote_cache_output_bytes": "32MiB",
            "remote_cache_memory_bytes": 0,
            "remote_cache_frame_timeout_s": 3,
        }
    ],
    indirect=True,
)
def test_unread_gets_pin_no_more_than_the_output_budget(server: Served, reliability) -> None:
    """A read token sends GET for a 24 MiB value on 12 connections and never reads the
    replies (values are not kept in memory here, so each GET reads its own copy). Only what
    fits the 32 MiB budget of replies not yet taken is read; the other GETs are answered
    nil; the reply nobody takes is cut off by the frame timeout."""
    port = server.resp_port
    value = b"".join(i.to_bytes(4, "little") for i in range(6 * MiB))  # 24 MiB, incompressible
    writer = authed(port)
    writer.sendall(command(b"SET", b"big", value))
    assert replies(writer, 1) == [b"+OK"]
    deadline = time.monotonic() + 20
    while metric(server, "cachekeeper_remote_cache_puts_total", result="stored") < 1:
        assert time.monotonic() < deadline, "the value was not stored"
        time.sleep(0.1)
    writer.close()
    baseline = warm(server)
    readers = []
    for _ in range(12):
        sock = authed(port, b"node-read")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.sendall(command(b"GET", b"big"))
        readers.append(sock)
    time.sleep(1.5)
    grown = rss_bytes(server.pid) - baseline
    busy = metric(server, "cachekeeper_remote_cache_gets_total", result="busy")
    assert grown < 64 * MiB, f"the server grew {grown / MiB:.0f} MiB"
    assert busy >= 10
    deadline = time.monotonic() + 10
    while (
        metric(server, "cachekeeper_remote_cache_connections_closed_total", reason="send_timeout")
        < 1
    ):
        assert time.monotonic() < deadline, "the unread reply was never cut off"
        time.sleep(0.2)
    for sock in readers:
        sock.close()
    reliability.record(
        f"read token: 12 GETs of a 24 MiB value never read: the server's RSS +{grown / MiB:.0f}"
        f" MiB (the 32 MiB budget of replies not taken; before: 736 MB for 12), {busy:.0f}"
        " answered nil, the unread reply cut off by the frame timeout",
        tries=12,
        outcome="kept",
        area="tier listener",
    )


# -- descriptors ----------------------------------------------------------------------------

FLOOD = 1100
NOFILE = 1024


def test_one_descriptor_budget_keeps_the_api_and_real_nodes_up(tmp_path: Path, reliability) -> None:
    """A real ``serve`` with a 1,024 open-file limit and the tier on: 1,100 idle RESP
    connections (550 never authenticate, 550 authenticate with the read token and idle),
    then 1,100 HTTP connections that trickle their headers. Through both, ``/healthz``
    answers every probe, a real node (redis-py) SETs and GETs through the tier, and the
    server never holds more descriptors than its limit."""
    raise_own_file_limit(2 * FLOOD + 512)
    server = serve(tmp_path, nofile=NOFILE, header_timeout_s=4)
    port = server.resp_port
    attackers: list[socket.socket] = []
    try:
        with PeakFds(server.pid) as fds_resp:
            for i in range(FLOOD):
                sock = connect(port)
                if i % 2:
                    sock.sendall(command(b"AUTH", b"node-read"))
                attackers.append(sock)
            time.sleep(1.0)
            probes = [httpx.get(f"{server.url}/healthz", timeout=5).status_code for _ in range(20)]
            node_resp = run_node(port)
        assert probes == [200] * 20
        assert node_resp.get("get") == "value", node_resp
        assert fds_resp.peak < NOFILE
        for sock in attackers:
            sock.close()
        attackers = []
        with PeakFds(server.pid) as fds_http:
            for _ in range(FLOOD):
                sock = socket.create_connection(("127.0.0.1", server.process.port), timeout=5)
                sock.sendall(b"G")
                attackers.append(sock)
            time.sleep(1.0)
            node_http = run_node(port, key="pt2:fx-graph-v1::during-http:c1")
            probe = httpx.get(f"{server.url}/healthz", timeout=5).status_code
        assert node_http.get("get") == "value", node_http
        assert probe == 200 and fds_http.peak < NOFILE
        evicted = metric(
            server, "cachekeeper_remote_cache_connections_closed_total", reason="evicted"
        )
    finally:
        for sock in attackers:
            sock.close()
        server.process.kill()
    assert evicted > 0
    reliability.record(
        f"{FLOOD:,} idle RESP connections (half unauthenticated, half with a read token),"
        f" then {FLOOD:,} HTTP connections trickling headers, server open-file limit"
        f" {NOFILE:,}: /healthz answered all probes, a redis-py node's SET and GET worked"
        f" during each flood ({node_resp['seconds']:.2f} s, {node_http['seconds']:.2f} s),"
        f" the server held {fds_resp.peak} and {fds_http.peak} descriptors at most (each"
        " listener has its backlog and its share of one budget; at the RESP cap the oldest"
        " unauthenticated, then idle, connection is closed)",
        tries=2 * FLOOD,
        outcome="kept",
        area="tier listener",
    )


# -- in-process listeners ------------------------------------------------------------------


@pytest.fixture
def tier(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    options = {"tokens": TOKENS, **getattr(request, "param", {})}
    with start_server(Settings(data_dir=tmp_path / "data", resp_port=0, **options)) as handle:
        yield handle


def guesses_per_second(port: int, *, seconds: float, connections: int) -> float:
    """Wrong tokens answered per second to ``connections`` peers on one address that
    pipeline AUTHs and reconnect whenever the server closes them."""
    answered = [0] * connections
    stop = time.monotonic() + seconds

    def guess(slot: int) -> None:
        while time.monotonic() < stop:
            try:
                sock = connect(port, timeout_s=seconds)
                sock.sendall(command(b"AUTH", b"guess") * 64)
                buffer = b""
                sock.settimeout(max(0.01, stop - time.monotonic()))
                while time.monotonic() < stop:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    *lines, buffer = (buffer + chunk).split(b"\r\n")
                    answered[slot] += sum(line.startswith(b"-WRONGPASS") for line in lines)
                sock.close()
            except OSError:
                continue

    threads = [threading.Thread(target=guess, args=(i,)) for i in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 5)
    return sum(answered) / seconds


def test_failed_auth_backs_off_per_peer_address(tier: LiveServer, reliability) -> None:
    """Wrong tokens from one address, on one connection and on eight at once: the guesses
    answered per second fall to a few, while the same server checks a right token
    thousands of times a second, and a node on another address authenticates at once."""
    port = tier.resp_port
    assert port is not None
    sock = connect(port, source="127.0.0.3")
    started = time.monotonic()
    sock.sendall(command(b"AUTH", b"node-write") * 2000)
    assert replies(sock, 2000) == [b"+OK"] * 2000
    right_per_s = 2000 / (time.monotonic() - started)
    sock.close()
    one = guesses_per_second(port, seconds=3, connections=1)
    eight = guesses_per_second(port, seconds=3, connections=8)
    other = connect(port, source="127.0.0.2")
    started = time.monotonic()
    other.sendall(command(b"AUTH", b"node-write"))
    assert replies(other, 1) == [b"+OK"]
    other_s = time.monotonic() - started
    same = connect(port)  # the guessing address: answered or closed within a second
    started = time.monotonic()
    same.sendall(command(b"AUTH", b"node-write"))
    answer = replies(same, 1, timeout_s=1.8)
    same_s = time.monotonic() - started
    assert one < 12 and eight < 12, (one, eight)
    assert right_per_s > 50 * max(one, eight), (right_per_s, one, eight)
    assert other_s < 0.45  # not behind the guessing address's waits (0.5 s apart)
    assert answer in ([b"+OK"], []) and same_s < 1.8
    reliability.record(
        f"token guessing: {one:.1f} wrong tokens/s answered on one connection,"
        f" {eight:.1f}/s on 8 at once from one address (before: ~11,000/s per connection);"
        f" the same server checks {right_per_s:,.0f} right tokens/s, a node on another"
        f" address was let in in {other_s * 1000:.0f} ms",
        tries=int((one + eight) * 3),
        outcome="refused",
        area="tier listener",
    )


@pytest.mark.parametrize("tier", [{"tokens": {}}], indirect=True)
def test_an_http_request_from_a_web_page_stores_nothing(tier: LiveServer, reliability) -> None:
    """A laptop server with auth off: what a web page's form (``text/plain``) or ``fetch``
    makes the browser send to the tier's port closes the connection unanswered, as Redis
    does for ``POST`` and ``Host:``, so the inline SETs in its body never run."""
    port = tier.resp_port
    assert port is not None
    body = b"SET pt2:fx-graph-v1::evil:c1 pickle\r\n"
    requests = [
        b"POST / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: text/plain\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (port, len(body), body),
        b"PUT /x HTTP/1.1\r\nOrigin: http://evil.example\r\n\r\n" + body,
        b"host: 127.0.0.1\r\n" + body,
    ]
    answers = []
    for request in requests:
        sock = connect(port)
        sock.sendall(request)
        answers.append(replies(sock, 1, timeout_s=2))
        sock.close()
    time.sleep(0.3)
    sock = connect(port)
    sock.sendall(command(b"GET", b"pt2:fx-graph-v1::evil:c1"))
    assert replies(sock, 1) == [b"$-1"]
    assert answers == [[], [], []]
    assert tier.app.state.tier.totals()[0] == 0
    assert metric(tier, "cachekeeper_remote_cache_connections_closed_total", reason="http") == 3
    reliability.record(
        "auth-off server: an HTTP POST (a web page's text/plain form), a PUT and a bare"
        " Host: line carrying inline SETs to the RESP port: closed unanswered, nothing stored",
        tries=3,
        outcome="refused",
        area="tier listener",
    )


def test_a_set_with_a_dropped_or_overlong_expiry_answers_an_error(
    tier: LiveServer, reliability
) -> None:
    """``SET k v EX`` with the ``EX`` argument over the command's bound (dropped), with
    70,000 digits, with a number past 64 bits, or missing: each answered ``-ERR`` on a
    connection that still serves (before: the connection's task died with a traceback)."""
    port = tier.resp_port
    assert port is not None
    sock = authed(port)
    cases = [
        command(b"SET", b"k", b"v", b"EX", b"1" * 70_000),
        command(b"SET", b"k", b"v", b"EX", b"1" * 4000),
        command(b"SET", b"k", b"v", b"EX", b"99999999999999999999999"),
        command(b"SET", b"k", b"v", b"PX", b"-5"),
        command(b"SET", b"k", b"v", b"EX"),
    ]
    sock.sendall(b"".join(cases) + command(b"PING"))
    answers = replies(sock, len(cases) + 1)
    assert [a[:4] for a in answers[:-1]] == [b"-ERR"] * len(cases), answers
    assert answers[-1] == b"+PONG"
    assert metric(tier, "cachekeeper_remote_cache_connections_closed_total", reason="error") == 0
    reliability.record(
        "SET with an EX argument dropped as over-long, 4,000 digits, past 64 bits, negative"
        " or missing: -ERR each, the connection still answers",
        tries=len(cases),
        outcome="refused",
        area="tier listener",
    )


@pytest.mark.parametrize(
    "tier",
    [
        {
            "tokens": TOKENS,
            "remote_cache_auth_timeout_s": 1.0,
            "remote_cache_idle_timeout_s": 1.0,
            "remote_cache_frame_timeout_s": 1.0,
        }
    ],
    indirect=True,
)
def test_auth_idle_and_frame_timeouts_close_connections(tier: LiveServer, reliability) -> None:
    """A connection that never authenticates (even one that keeps PINGing), an
    authenticated one that goes quiet, and one that stalls mid-command are closed at their
    timeouts (1 s each here); a real node whose idle connection was closed reconnects on
    its next command without noticing."""
    port = tier.resp_port
    assert port is not None
    quiet = connect(port)
    pinging = connect(port)
    idle = authed(port)
    stalled = authed(port)
    stalled.sendall(b"*2\r\n$3\r\nGET\r\n$10\r\npt2")
    started = time.monotonic()
    for _ in range(4):
        try:
            pinging.sendall(command(b"PING"))
        except OSError:
            break  # closed already
        time.sleep(0.3)
    assert all(closed(s, wait_s=3) for s in (quiet, pinging, idle, stalled))
    waited = time.monotonic() - started
    script = f"""
import time, redis
r = redis.Redis.from_url('redis://:node-write@127.0.0.1:{port}/0?socket_timeout=2')
assert r.set('k', b'v') is True
time.sleep(1.6)  # past the idle timeout: the server closes this connection
assert r.get('k') == b'v'
print('ok')
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**__import__("os").environ, **redis_py_env(redis_py_versions()[-1])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    reasons = {
        r: metric(tier, "cachekeeper_remote_cache_connections_closed_total", reason=r)
        for r in ("auth_timeout", "idle_timeout", "frame_timeout")
    }
    assert reasons["auth_timeout"] == 2 and reasons["frame_timeout"] == 1
    assert reasons["idle_timeout"] >= 2  # ours, and the node's
    reliability.record(
        f"a connection that never authenticates, one that PINGs without authenticating, an"
        f" idle authenticated one, one stalled mid-command: all closed within {waited:.1f} s"
        " (timeouts of 1 s); a redis-py node closed while idle reconnected on its next GET",
        tries=4,
        outcome="kept",
        area="tier listener",
    )


@pytest.mark.parametrize(
    "tier", [{"tokens": TOKENS, "remote_cache_max_bytes": "256KiB"}], indirect=True
)
def test_tier_keys_and_writers_count_in_the_tiers_cap(tier: LiveServer, reliability) -> None:
    """Issue 32, class 6: 1,000 SETs of a 1-byte value under distinct 1,000-byte keys from a
    client whose name and library claim 8 KiB each (the catalog grew 189 MB under a 1 MiB
    cap when only values counted): what the tier keeps, keys and writers included, stays
    under its cap (256 KiB here); a key over ``remote_cache_max_key_bytes`` is not stored."""
    port = tier.resp_port
    assert port is not None
    sock = authed(port)
    names = command(b"CLIENT", b"SETNAME", b"n" * 8192) + command(
        b"CLIENT", b"SETINFO", b"LIB-NAME", b"l" * 8192
    )
    sock.sendall(names + command(b"SET", b"x" * 2000, b"v"))
    assert replies(sock, 3) == [b"+OK"] * 3
    batch = 500
    for start in range(0, 1000, batch):
        sock.sendall(
            b"".join(
                command(b"SET", b"%04d" % i + b"k" * 996, b"v") for i in range(start, start + batch)
            )
        )
        assert replies(sock, batch) == [b"+OK"] * batch
    sock.close()
    store = tier.app.state.tier
    deadline = time.monotonic() + 120
    while metric(tier, "cachekeeper_remote_cache_puts_total", result="stored") < 1000:
        assert time.monotonic() < deadline, "the writer did not store the values"
        time.sleep(0.1)
    totals = tier_totals(store.catalog)
    entry = tier_lru(store.catalog, limit=1)[0]
    meta = tier.settings.data_dir / "meta.sqlite"
    catalog_bytes = sum(p.stat().st_size for p in meta.parent.glob("meta.sqlite*"))
    assert totals.stored_bytes <= 256 << 10
    assert totals.keys < 250
    assert len(entry.writer["client"]) <= 128 and len(entry.writer["lib"]) <= 128
    assert tier_key(store.catalog, b"x" * 2000) is None
    assert metric(tier, "cachekeeper_remote_cache_puts_total", result="key_too_long") == 1
    reliability.record(
        f"1,000 SETs of 1 byte under distinct 1,000-byte keys, writer names of 8 KiB claimed,"
        f" under a 256 KiB cap: {totals.keys} keys kept, {totals.stored_bytes:,} bytes counted"
        f" (keys and writers included), the catalog files {catalog_bytes / MiB:.1f} MiB; a"
        " 2,000-byte key not stored (before: every key kept, 189 MB under a 1 MiB cap)",
        tries=1001,
        outcome="kept",
        area="tier listener",
    )
