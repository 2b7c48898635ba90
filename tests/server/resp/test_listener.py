"""The per-key tier's protocol, spoken by the real redis-py versions torch users have.

Each case runs redis-py (7.4 and 8.1, installed side by side by scripts/setup) in a child
process against a real server on loopback, so the handshake is the library's own: RESP2
with ``AUTH`` (7.x), ``HELLO 3 AUTH`` (8.x), ``CLIENT SETINFO``, ``CLIENT
MAINT_NOTIFICATIONS``, ``CLIENT SETNAME`` from the URL. What torch depends on: GET and SET
round-trip bytes exactly; a refused token or a missing one raises a ConnectionError
(torch's only catch) at once; a SET never answers an error; garbage on one connection
closes that connection only.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cachekeeper.server.auth import token_id
from cachekeeper.server.resources.tier_keys import tier_key
from cachekeeper.server.settings import Settings
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.metrics import sample
from tests.helpers.redis_py import redis_py_env, redis_py_versions
from tests.helpers.resp import command, connect, replies

VERSIONS = redis_py_versions()
TOKENS = {"tier-write": "write", "tier-read": "read"}

# Without both versions the parametrized tests below fail at collection (pyproject's
# empty_parameter_set_mark) and the rest fail by the fixture: never a silent skip.
pytestmark = pytest.mark.usefixtures("redis_py")


def run_client(version: str, code: str, *, timeout_s: float = 60) -> dict:
    """Run ``code`` (which sets ``out``) with redis-py ``version``; its ``out`` as a dict."""
    script = f"import json, time, redis\nout = {{'version': redis.__version__}}\n{code}\nprint(json.dumps(out))"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**__import__("os").environ, **redis_py_env(version)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == version
    return out


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("tier") / "data"
    settings = Settings(
        data_dir=data, tokens=TOKENS, resp_port=0, remote_cache_max_value_bytes=4 << 20
    )
    with start_server(settings) as handle:
        yield handle


def url(handle: LiveServer, token: str | None = "tier-write", query: str = "") -> str:
    auth = f":{token}@" if token else ""
    return f"redis://{auth}127.0.0.1:{handle.resp_port}/0?socket_timeout=5{query}"


def metric(handle: LiveServer, name: str, **labels: str) -> float:
    return float(handle.app.state.metrics.value(name, **labels))


def wait_stored(handle: LiveServer, keys: int) -> None:
    deadline = time.monotonic() + 10
    while handle.app.state.tier.totals()[0] < keys:
        assert time.monotonic() < deadline, "the tier's writer did not store the values"
        time.sleep(0.02)


@pytest.mark.parametrize("version", VERSIONS)
def test_get_and_set_round_trip_bytes_exactly_after_each_versions_handshake(
    tier: LiveServer, version: str
) -> None:
    key = f"pt2:fx-graph-v1::k-{version}:c1"
    value = bytes(range(256)) * 4096  # 1 MiB, every byte value, CRLF included
    out = run_client(
        version,
        f"""
value = bytes(range(256)) * 4096
r = redis.Redis.from_url({url(tier, query="&client_name=ck:node-a:abc")!r})
out['miss'] = r.get({key!r})
out['set'] = r.set({key!r}, value)
out['ex'] = r.set({key + "ex"!r}, b'v', ex=3600)
for _ in range(200):
    got = r.get({key!r})
    if got is not None:
        break
    time.sleep(0.02)
out['same'] = got == value
out['ping'] = r.ping()
""",
    )
    assert out["miss"] is None and out["set"] is True and out["ex"] is True
    assert out["same"] is True and out["ping"] is True
    wait_stored(tier, 1)
    entry = tier_key(tier.app.state.tier.catalog, key.encode())
    assert entry is not None and entry.size_bytes == len(value)
    assert entry.writer["client"] == "ck:node-a:abc"
    assert entry.writer["lib"] == f"redis-py {version}" and entry.writer["scope"] == "write"
    assert entry.writer["token"] == token_id("tier-write")  # from AUTH, not the name


def test_a_keys_writer_is_its_token_and_another_environment_reads_a_miss(
    tier: LiveServer,
) -> None:
    """Issue 32 class 6: the writer is the token that AUTHed, whatever name the client
    claims; a value written from one environment (the client name prejob sets,
    ck:<node>:<12 hex>) is a miss for a reader from another."""
    version = VERSIONS[-1]
    key = "pt2:fx-graph-v1::envcheck:c1"
    writer = url(tier, query="&client_name=ck:builder-1:0123456789ab")
    other = url(tier, token="tier-read", query="&client_name=ck:node-b:ffffffffffff")
    same = url(tier, token="tier-read", query="&client_name=ck:node-c:0123456789ab")
    out = run_client(
        version,
        f"""
redis.Redis.from_url({writer!r}).set({key!r}, b'value')
for _ in range(200):
    if redis.Redis.from_url({same!r}).get({key!r}) is not None:
        break
    time.sleep(0.02)
out['same'] = redis.Redis.from_url({same!r}).get({key!r}) == b'value'
""",
    )
    assert out["same"] is True
    deadline = time.monotonic() + 10
    while tier_key(tier.app.state.tier.catalog, key.encode()) is None:  # stored, not pending
        assert time.monotonic() < deadline
        time.sleep(0.02)
    out = run_client(version, f"out['other'] = redis.Redis.from_url({other!r}).get({key!r})")
    assert out["other"] is None
    entry = tier_key(tier.app.state.tier.catalog, key.encode())
    assert entry.writer["token"] == token_id("tier-write") and entry.writer["scope"] == "write"
    assert entry.writer["environment"] == "0123456789ab"
    assert metric(tier, "cachekeeper_remote_cache_gets_total", result="other_environment") >= 1


@pytest.mark.parametrize("version", VERSIONS)
def test_a_missing_or_wrong_token_is_a_connection_error_at_once(
    tier: LiveServer, version: str
) -> None:
    out = run_client(
        version,
        f"""
for name, u in (('none', {url(tier, None)!r}), ('wrong', {url(tier, "nope")!r})):
    started = time.monotonic()
    try:
        redis.Redis.from_url(u).get('k')
        out[name] = 'answered'
    except redis.exceptions.ConnectionError as exc:
        out[name] = type(exc).__name__
    out[name + '_s'] = time.monotonic() - started
""",
    )
    assert out["none"] == "AuthenticationError" and out["wrong"] == "AuthenticationError"
    assert out["none_s"] < 1 and out["wrong_s"] < 1  # redis-py does not retry it


@pytest.mark.parametrize("version", VERSIONS)
def test_a_read_only_token_reads_and_its_sets_are_answered_ok_and_dropped(
    tier: LiveServer, version: str
) -> None:
    before = metric(tier, "cachekeeper_remote_cache_puts_total", result="read_only_token")
    key = f"pt2:autograd-experimental::ro-{version}:c1"
    out = run_client(
        version,
        f"""
r = redis.Redis.from_url({url(tier, "tier-read")!r})
out['set'] = r.set({key!r}, b'code torch would run')
time.sleep(0.3)
out['get'] = r.get({key!r})
""",
    )
    assert out["set"] is True and out["get"] is None
    assert (
        metric(tier, "cachekeeper_remote_cache_puts_total", result="read_only_token") == before + 1
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_a_value_over_the_cap_is_answered_ok_and_not_stored(tier: LiveServer, version: str) -> None:
    before = metric(tier, "cachekeeper_remote_cache_puts_total", result="too_large")
    out = run_client(
        version,
        f"""
r = redis.Redis.from_url({url(tier)!r})
out['set'] = r.set('big-{version}', b'x' * (5 << 20))
out['after'] = r.set('small-{version}', b'y')  # the connection is still in step
time.sleep(0.3)
out['get'] = r.get('big-{version}')
out['small'] = r.get('small-{version}') == b'y'
""",
    )
    assert out["set"] is True and out["after"] is True and out["get"] is None
    assert out["small"] is True
    assert metric(tier, "cachekeeper_remote_cache_puts_total", result="too_large") == before + 1


def test_anything_else_is_a_clear_error(tier: LiveServer) -> None:
    out = run_client(
        VERSIONS[-1],
        f"""
r = redis.Redis.from_url({url(tier)!r})
for name, cmd in (('keys', ('KEYS', '*')), ('select', ('SELECT', '3')), ('setnx', ('SET', 'a', 'b', 'NX'))):
    try:
        r.execute_command(*cmd)
        out[name] = 'answered'
    except redis.exceptions.ResponseError as exc:
        out[name] = str(exc)
""",
    )
    assert out["keys"].startswith("unknown command 'KEYS'")
    assert "database 0 only" in out["select"]
    assert "SET key value [EX s|PX ms]" in out["setnx"]


def _raw(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_garbage_closes_that_connection_only(tier: LiveServer) -> None:
    before = metric(tier, "cachekeeper_remote_cache_protocol_errors_total")
    with socket.create_connection(("127.0.0.1", tier.resp_port), timeout=5) as good:
        good.sendall(b"*3\r\n$4\r\nAUTH\r\n$7\r\ndefault\r\n$10\r\ntier-write\r\n")
        assert good.recv(100) == b"+OK\r\n"
        for garbage in (
            b"*1\r\n$99999999999\r\nx",
            b"*2\r\n:1\r\n",
            b"*9999\r\n",
            b"\x16\x03\x01\x02\x00",
        ):
            answer = _raw(tier.resp_port, garbage)  # the server answers, then closes
            assert answer.startswith(b"-ERR"), answer
        good.sendall(b"*1\r\n$4\r\nPING\r\n")
        assert good.recv(100) == b"+PONG\r\n"
    assert metric(tier, "cachekeeper_remote_cache_protocol_errors_total") >= before + 3
    assert _raw(tier.resp_port, b"PING\r\nQUIT\r\n") == b"+PONG\r\n+OK\r\n"  # inline, as telnet


def test_the_tier_shows_in_metrics(tier: LiveServer) -> None:
    keys = tier.app.state.tier.totals()[0]
    sock = connect(tier.resp_port or 0)
    sock.sendall(command(b"AUTH", b"tier-write") + command(b"SET", b"shown-key", b"v"))
    assert replies(sock, 2) == [b"+OK", b"+OK"]
    wait_stored(tier, keys + 1)
    sock.sendall(command(b"GET", b"shown-key"))  # a hit of its own, whatever ran before
    assert replies(sock, 1) == [b"$1 v"]
    sock.close()
    text = httpx.get(f"{tier.url}/metrics", headers={"Authorization": "Bearer tier-read"}).text
    assert "cachekeeper_remote_cache_keys " in text
    assert 'cachekeeper_remote_cache_gets_total{result="hit"}' in text


def test_tier_gets_and_puts_are_timed_by_result(tier: LiveServer) -> None:
    """A GET is timed from its command to its reply, by the result gets_total counts it
    under; a PUT by the writer's store of the value, after the SET was answered."""
    seconds = "cachekeeper_remote_cache_get_seconds"
    hits, misses = metric(tier, seconds, result="hit"), metric(tier, seconds, result="miss")
    stored = metric(tier, "cachekeeper_remote_cache_put_seconds", result="stored")
    keys = tier.app.state.tier.totals()[0]
    sock = connect(tier.resp_port or 0)
    sock.sendall(command(b"AUTH", b"tier-write") + command(b"SET", b"timed-key", b"v" * 1000))
    assert replies(sock, 2) == [b"+OK", b"+OK"]
    wait_stored(tier, keys + 1)
    sock.sendall(command(b"GET", b"timed-key") + command(b"GET", b"no-such-timed-key"))
    assert replies(sock, 2) == [b"$1000 " + b"v" * 1000, b"$-1"]
    sock.close()
    assert metric(tier, seconds, result="hit") == hits + 1
    assert metric(tier, seconds, result="miss") == misses + 1
    assert metric(tier, "cachekeeper_remote_cache_put_seconds", result="stored") == stored + 1
    text = httpx.get(f"{tier.url}/metrics", headers={"Authorization": "Bearer tier-read"}).text
    assert sample(text, seconds + "_bucket", result="hit", le="+Inf") == hits + 1


def test_a_server_without_the_port_serves_no_tier(tmp_path: Path) -> None:
    with start_server(Settings(data_dir=tmp_path / "data")) as handle:
        assert handle.resp_port is None and handle.app.state.tier is None


def test_the_status_page_shows_the_tier(tmp_path: Path) -> None:
    with start_server(Settings(data_dir=tmp_path / "data", resp_port=0)) as handle:
        assert handle.resp_port is not None
        _raw(handle.resp_port, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nvalue\r\n*1\r\n$4\r\nQUIT\r\n")
        wait_stored(handle, 1)
        _raw(
            handle.resp_port,
            b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*2\r\n$3\r\nGET\r\n$1\r\nx\r\nQUIT\r\n",
        )
        page = httpx.get(f"{handle.url}/ui").text
    assert '<table id="tier">' in page
    row = page.split('<table id="tier">')[1].split("</table>")[0]
    cells = [c.split("<")[0] for c in row.split("<td>")[1:]]
    assert cells[0] == str(handle.resp_port) and cells[1] == "1"  # port, keys
    assert cells[3:6] == ["1", "1", "1"]  # hits, misses, puts stored


@pytest.mark.parametrize("opt_in", [False, True])
def test_with_a_trust_list_the_tier_is_read_only_unless_the_operator_opts_in(
    tmp_path: Path, opt_in: bool
) -> None:
    from cachekeeper.snapshot.signing import generate_keypair

    _, pub, _ = generate_keypair(tmp_path / "builder")
    settings = Settings(
        data_dir=tmp_path / "data",
        tokens={"admin-token": "admin"},
        resp_port=0,
        trusted_keys=[pub],
        remote_cache_unsigned_writes=opt_in,
    )
    with start_server(settings) as handle:
        out = run_client(
            VERSIONS[-1],
            f"""
r = redis.Redis.from_url({url(handle, "admin-token")!r})
out['set'] = r.set('k', b'unsigned code')
time.sleep(0.3)
out['get'] = r.get('k') == b'unsigned code'
""",
        )
        offer = httpx.get(
            f"{handle.url}/v1/remote-cache", headers={"Authorization": "Bearer admin-token"}
        ).json()
        dropped = metric(
            handle, "cachekeeper_remote_cache_puts_total", result="signatures_required"
        )
    assert out["set"] is True  # never an error torch would raise on
    assert out["get"] is opt_in and offer["writable"] is opt_in
    assert dropped == (0 if opt_in else 1)


def test_sets_past_the_pending_budget_are_answered_ok_and_dropped(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", resp_port=0, remote_cache_pending_bytes=1000)
    with start_server(settings) as handle:
        assert handle.resp_port is not None
        value = b"v" * 2000  # under the cap, over what may wait to be stored
        answer = _raw(
            handle.resp_port,
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2000\r\n" + value + b"\r\n*1\r\n$4\r\nQUIT\r\n",
        )
        assert answer == b"+OK\r\n+OK\r\n"
        assert metric(handle, "cachekeeper_remote_cache_puts_total", result="busy") == 1
        assert handle.app.state.tier.totals()[0] == 0


@pytest.mark.slow  # a serve process
def test_serve_refuses_a_resp_port_it_cannot_bind_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("cachekeeper")), "serve", "--data",
             str(tmp_path / "data"), "--port", "0", "--resp-port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"cannot serve the per-key tier on 127.0.0.1:{port} (--resp-port)" in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_at_the_cap_idle_connections_make_room_for_a_node(tmp_path: Path) -> None:
    """With every connection idle at the cap (16 here), a node's connection closes the one
    idle longest and works; the closed one's redis-py would reconnect on its next command."""
    settings = Settings(
        data_dir=tmp_path / "data", tokens=TOKENS, resp_port=0, remote_cache_max_connections=16
    )
    with start_server(settings) as handle:
        assert handle.resp_port is not None
        idle = []
        for _ in range(16):
            sock = socket.create_connection(("127.0.0.1", handle.resp_port), timeout=5)
            sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$9\r\ntier-read\r\n")
            assert sock.recv(100) == b"+OK\r\n"
            idle.append(sock)
        out = run_client(
            VERSIONS[-1],
            f"""
r = redis.Redis.from_url({url(handle)!r})
out['set'] = r.set('k', b'v')
out['get'] = r.get('k') == b'v'  # stored, or still queued: either is served
""",
        )
        evicted = metric(
            handle, "cachekeeper_remote_cache_connections_closed_total", reason="evicted"
        )
        idle[0].settimeout(2)
        first_closed = idle[0].recv(100) == b""
        for sock in idle:
            sock.close()
    assert out["set"] is True and out["get"] is True
    assert evicted >= 1 and first_closed
