"""The per-key tier's listener: the subset of the Redis protocol torch's remote caches speak.

torch's FX graph, AOTAutograd, autotune and PGO remote caches reach a server through
redis-py (``torch/_inductor/remote_cache.py``): after redis-py's handshake they send only
``GET key`` and ``SET key value`` (``EX seconds`` on torch main). The handshake, read in
redis-py 7.4 and 8.1 and replayed by ``tests/server/resp/test_listener.py`` with both:

    redis-py 7, password:  AUTH tok; CLIENT SETINFO LIB-NAME ..; CLIENT SETINFO LIB-VER ..
    redis-py 8, password:  HELLO 3 AUTH default tok; CLIENT MAINT_NOTIFICATIONS ON ..;
                           CLIENT SETINFO LIB-NAME ..; CLIENT SETINFO LIB-VER ..
    redis-py 8, none:      HELLO 3; CLIENT MAINT_NOTIFICATIONS ON ..; CLIENT SETINFO ..
    a URL's client_name:   CLIENT SETNAME name;   a URL's /N with N != 0: SELECT N

Served: RESP2 and RESP3 (``HELLO 2|3``), ``AUTH`` (a token as password; a username is
ignored), ``CLIENT SETINFO|SETNAME|GETNAME|ID|MAINT_NOTIFICATIONS``, ``SELECT 0``,
``PING``, ``ECHO``, ``QUIT``, ``COMMAND`` (empty), ``GET``, ``SET`` with or without
``EX``/``PX``; anything else answers ``-ERR``. The wire format is ``server/resp/protocol.py``.

The rule that shapes every answer: torch catches only redis-py's ConnectionError, and an
error reply to a ``SET`` (or a rejected ``HELLO``) makes the compile raise. So a GET or a
SET with torch's arguments is never answered with an error torch would raise on:

- a SET from a token without the write scope, while the tier is read-only (signatures),
  of a key over ``remote_cache_max_key_bytes``, of a value over the cap, or while the
  values waiting to be stored are over their budget, is answered ``+OK`` and dropped
  (``cachekeeper_remote_cache_puts_total`` counts why); accepted values are stored by one
  writer thread after the answer;
- a GET the store does not answer within ``remote_cache_get_timeout_s``, or whose value
  would pass the budget of replies not yet taken, is answered nil;
- with auth on, anything but ``AUTH``/``HELLO``/``PING``/``QUIT`` before auth is answered
  ``-NOAUTH`` and a wrong token ``-WRONGPASS``: redis-py raises AuthenticationError, a
  ConnectionError, at once (it does not retry it), and torch turns that remote cache off;
- too many connections: ``-ERR max number of clients reached`` (a ConnectionError too);
- garbage on the socket (not RESP, a bulk length out of range) is answered
  ``-ERR Protocol error`` and that connection is closed; an HTTP request is closed without
  a reply; no other connection notices.

What one connection may cost (frames, connections at the cap, failed-auth backoff,
replies not taken) is bounded by ``server/resp/bounds.py``; the listener applies three
timeouts around its reads: a connection must authenticate within
``remote_cache_auth_timeout_s`` of opening, an authenticated one idle for
``remote_cache_idle_timeout_s`` is closed (redis-py reconnects on its next command), and a
command must arrive, and its reply be taken, within ``remote_cache_frame_timeout_s``.

With ``--tls-cert``/``--tls-key`` the listener speaks TLS with the same certificate as the
HTTP port (redis-py: ``rediss://``), so a node's token never crosses in clear.

The listener runs an asyncio loop in its own thread; store reads run in a small thread
pool, so a slow store never holds the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachekeeper.errors import ConfigInvalid
from cachekeeper.remote_tier import environment_of_client_name
from cachekeeper.server.auth import scope_of_token, token_id
from cachekeeper.server.connections import connection_budget, raise_open_file_limit
from cachekeeper.server.metrics import Metrics
from cachekeeper.server.resources.tier import Tier, TierWriter, queued_bytes
from cachekeeper.server.settings import Settings

from .bounds import (
    AUTHED,
    MAX_FAILURES_PER_CONNECTION,
    PREAUTH,
    AuthThrottle,
    ByteBudget,
    Clients,
    Held,
    bounded_name,
)
from .protocol import (
    LINE_BYTES,
    CrossProtocol,
    Dropped,
    ProtocolError,
    Reply,
    bulk,
    bulk_parts,
    error,
    expiry_problem,
    integer,
    map_reply,
    next_byte,
    nil,
    read_rest,
    simple,
)

__all__ = ["RespServer"]

_log = logging.getLogger("cachekeeper.server.resp")

_GET_WORKERS = 8
TLS_HANDSHAKE_TIMEOUT_S = 10.0
_SEND_CHUNK = 1 << 20
_BEFORE_AUTH = frozenset({b"AUTH", b"HELLO", b"PING", b"QUIT"})
_WRONGPASS = "WRONGPASS invalid username-password pair or user is disabled."


@dataclass(eq=False)
class _Conn:
    peer: str
    writer: asyncio.StreamWriter
    scope: str | None  # None: not authenticated
    auth_deadline: float  # the loop's time by which it must authenticate
    token: str | None = None  # the token's id (auth.token_id) once AUTH accepted one
    id: int = 0
    proto: int = 2
    name: str = ""
    lib_name: str = ""
    lib_ver: str = ""
    closing: bool = False
    auth_failures: int = 0
    reserved_bytes: int = 0  # a SET's share of the writer's budget while its value is read
    held: Held | None = None  # a GET's share of the output budget while its reply is sent
    get_started: float = 0.0  # when its GET came (perf_counter), for the GET's histogram


class RespServer:
    """The tier's listener on ``settings.host``:``settings.resp_port``; ``start()``/``stop()``."""

    def __init__(self, *, store: Tier, settings: Settings, metrics: Metrics) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.port: int | None = None
        # The cap is the tier's share of the descriptor budget, set by start().
        self.clients = Clients(settings.remote_cache_max_connections or 16, evict=self._evict)
        self._next_id = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._reads = concurrent.futures.ThreadPoolExecutor(
            max_workers=_GET_WORKERS, thread_name_prefix="cachekeeper-tier-get"
        )
        self._writer = TierWriter(store, metrics, budget_bytes=settings.remote_cache_pending_bytes)
        self._output = ByteBudget(settings.remote_cache_output_bytes)
        self._throttle = AuthThrottle()
        self._warned_http = False

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> int:
        """Bind (ConfigInvalid naming the address when it cannot), serve in a thread; the port."""
        host, port = self.settings.host, self.settings.resp_port or 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(512)
        except OSError as exc:
            sock.close()
            raise ConfigInvalid(
                f"cannot serve the per-key tier on {host}:{port} (--resp-port): {exc.strerror or exc}"
            ) from exc
        sock.setblocking(False)
        tls = self._tls_context()
        self.port = int(sock.getsockname()[1])
        budget = connection_budget(self.settings, open_files=raise_open_file_limit())
        self.clients.cap = budget.resp
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(
                    self._serve,
                    sock=sock,
                    limit=LINE_BYTES,
                    backlog=budget.backlog,
                    ssl=tls,
                    ssl_handshake_timeout=None if tls is None else TLS_HANDSHAKE_TIMEOUT_S,
                )
            )
            started.set()
            self._loop.run_forever()

        self._writer.start()
        self._thread = threading.Thread(target=run, name="cachekeeper-resp", daemon=True)
        self._thread.start()
        started.wait(10)
        return self.port

    def _tls_context(self) -> ssl.SSLContext | None:
        """TLS with the HTTP port's certificate (``--tls-cert``/``--tls-key``), or None."""
        if self.settings.tls_cert is None or self.settings.tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.settings.tls_cert, self.settings.tls_key)
        return context

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Stop accepting, close connections, store what is queued."""
        if self._thread is None:
            return
        loop = self._loop

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:  # let each connection close its socket before the loop stops
                await asyncio.wait(tasks, timeout=min(2.0, timeout_s))

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout_s)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout_s)
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._writer.stop(timeout_s=timeout_s)
        self._thread = None

    # -- one connection -----------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self._open(writer)
        if not self.clients.admit(conn, authenticated=conn.scope is not None):
            self._closed("max_clients")  # every connection is in the middle of a command
            writer.write(error("ERR max number of clients reached"))
            await self._close(writer)
            return
        try:
            while not conn.closing:
                args = await self._read(conn, reader)
                if args is None:
                    break
                if not args:
                    continue
                reply = await self._dispatch(conn, args)
                self._release_reserved(conn)
                if reply is None or not await self._send(conn, reply):
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # noqa: BLE001 - a bug ends its connection, never the listener
            _log.exception("per-key tier: a connection from %s failed", conn.peer)
            self._closed("error")
        finally:
            self._release_reserved(conn)
            self.clients.remove(conn)
            await self._close(writer)

    def _open(self, writer: asyncio.StreamWriter) -> _Conn:
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        scope = "admin" if not self.settings.auth_enabled else None
        if scope is None and self.settings.anonymous_read:
            scope = "anonymous"
        self._next_id += 1
        return _Conn(
            peer=str(peer[0]) if peer else "",
            writer=writer,
            scope=scope,
            auth_deadline=self._loop.time() + self.settings.remote_cache_auth_timeout_s,
            id=self._next_id,
        )

    async def _read(self, conn: _Conn, reader: asyncio.StreamReader) -> list[Any] | None:
        """The next command (``[]`` for a blank line), or None when the connection is to
        close: the end of its stream, a timeout, or a frame that is not RESP (answered)."""
        authed = conn.scope is not None
        settings = self.settings
        if authed:
            self.clients.idle(conn)
        wait_s = settings.remote_cache_idle_timeout_s
        if not authed:
            wait_s = max(0.0, conn.auth_deadline - self._loop.time())
        try:
            async with asyncio.timeout(wait_s):
                first = await next_byte(reader)
        except TimeoutError:
            self._closed("idle_timeout" if authed else "auth_timeout")
            return None
        if first is None:
            return None
        self.clients.busy(conn)
        frame_s = settings.remote_cache_frame_timeout_s
        if not authed:
            frame_s = min(frame_s, max(0.0, conn.auth_deadline - self._loop.time()))
        keep = functools.partial(self._keep, conn)
        try:
            async with asyncio.timeout(frame_s):
                return await read_rest(
                    reader, first, limits=AUTHED if authed else PREAUTH, keep=keep
                )
        except TimeoutError:
            self._closed("frame_timeout" if authed else "auth_timeout")
        except CrossProtocol:
            self._closed("http")
            if not self._warned_http:
                self._warned_http = True
                _log.warning(
                    "per-key tier: %s sent an HTTP request to the Redis port (a web page"
                    " trying cross-protocol requests?); closed without a reply. Further ones"
                    ' are counted in cachekeeper_remote_cache_connections_closed_total{reason="http"}',
                    conn.peer,
                )
        except ProtocolError as exc:
            self.metrics.inc("cachekeeper_remote_cache_protocol_errors_total")
            self._closed("protocol_error")
            conn.writer.write(error(f"ERR Protocol error: {exc}"))
        return None

    async def _send(self, conn: _Conn, reply: Reply) -> bool:
        """Send ``reply``; False (the connection aborted) when the client does not take it
        within the frame timeout. A value larger than ``_SEND_CHUNK`` goes out a chunk at a
        time, each taken before the next is written, so the transport never holds a copy of
        more than a chunk (Python 3.11's copies what the socket did not take at once). A
        GET's share of the output budget is given back once the client took its reply."""
        writer = conn.writer
        try:
            async with asyncio.timeout(self.settings.remote_cache_frame_timeout_s):
                if isinstance(reply, bytes):
                    writer.write(reply)
                elif sum(map(len, reply)) <= _SEND_CHUNK:
                    writer.writelines(reply)  # one sendmsg on Python 3.12
                else:
                    for part in reply:
                        view = memoryview(part)
                        for start in range(0, len(view), _SEND_CHUNK):
                            writer.write(view[start : start + _SEND_CHUNK])
                            await writer.drain()
                await writer.drain()
        except TimeoutError:
            self._closed("send_timeout")
            writer.transport.abort()
            return False
        finally:
            if conn.held is not None:
                conn.held.give_back()
                conn.held = None
        return True

    def _evict(self, conn: _Conn) -> None:
        """Close ``conn`` to make room for a new connection at the cap."""
        self._closed("evicted")
        conn.closing = True
        conn.writer.transport.close()

    def _closed(self, reason: str) -> None:
        self.metrics.inc("cachekeeper_remote_cache_connections_closed_total", reason=reason)

    @staticmethod
    async def _close(writer: asyncio.StreamWriter) -> None:
        try:
            await writer.drain()
            writer.close()
            await writer.wait_closed()
        except (ConnectionError, asyncio.CancelledError, RuntimeError):
            pass

    def _keep(self, conn: _Conn, args: list[Any], length: int) -> bool:
        """Whether the next bulk is a SET's value this connection may store: then its
        bytes (and its key's) are reserved in the writer's budget before they are read."""
        if len(args) != 2 or not isinstance(args[0], bytes) or args[0].upper() != b"SET":
            return False
        key = args[1]
        if (
            not self._may_write(conn)
            or not isinstance(key, bytes)
            or len(key) > self.settings.remote_cache_max_key_bytes
            or length > self.settings.remote_cache_max_value_bytes
        ):
            return False  # read and dropped: its SET is answered OK, counted by _cmd_set
        cost = queued_bytes(key, length)
        if not self._writer.reserve(cost):
            return False
        conn.reserved_bytes = cost
        return True

    def _may_write(self, conn: _Conn) -> bool:
        return conn.scope in ("write", "admin") and self.settings.remote_cache_writable

    def _release_reserved(self, conn: _Conn) -> None:
        if conn.reserved_bytes:
            self._writer.release(conn.reserved_bytes)
            conn.reserved_bytes = 0

    async def _dispatch(self, conn: _Conn, args: list[Any]) -> Reply | None:
        """The reply to ``args``, or None to close the connection without one."""
        name = args[0].upper() if isinstance(args[0], bytes) else b""
        rest = args[1:]
        if conn.scope is None and name not in _BEFORE_AUTH:
            return error("NOAUTH Authentication required.")
        handler = _COMMANDS.get(name)
        if handler is None:
            shown = name.decode(errors="replace")[:40] if name else "?"
            return error(f"ERR unknown command '{shown}', with args beginning with: ")
        if any(isinstance(a, Dropped) for a in rest) and name not in (b"SET", b"GET"):
            return error("ERR argument too long")
        reply: Reply | None = await handler(self, conn, rest)
        return reply

    # -- commands -------------------------------------------------------------------------
    async def _authenticate(self, conn: _Conn, password: bytes) -> bool | None:
        """True: ``password`` is a token (the connection has its scope); False: it is not
        (counted, and the next attempt from this peer waits longer); None: not checked,
        since too many attempts from this peer are waiting (close the connection)."""
        wait_s = self._throttle.wait_s(conn.peer, connection_failures=conn.auth_failures)
        if wait_s is None:
            self._closed("auth_throttled")
            return None
        if wait_s:
            await asyncio.sleep(wait_s)
        scope = scope_of_token(self.settings, password.decode(errors="replace"))
        if scope is None:
            self.metrics.inc("cachekeeper_remote_cache_auth_failures_total")
            self._throttle.failed(conn.peer)
            conn.auth_failures += 1
            if conn.auth_failures >= MAX_FAILURES_PER_CONNECTION:
                self._closed("auth_failures")
                conn.closing = True  # after this answer
            return False
        if conn.scope is None:
            self.clients.authenticated(conn)
        conn.scope = scope
        conn.token = token_id(password.decode(errors="replace"))
        return True

    async def _cmd_auth(self, conn: _Conn, rest: list[Any]) -> bytes | None:
        if len(rest) not in (1, 2):
            return error("ERR wrong number of arguments for 'auth' command")
        if not self.settings.auth_enabled:
            return simple("OK")  # a node with a token, a server without auth: let it in
        checked = await self._authenticate(conn, rest[-1])
        if checked is None:
            return None
        return simple("OK") if checked else error(_WRONGPASS)

    async def _cmd_hello(self, conn: _Conn, rest: list[Any]) -> bytes | None:
        proto = conn.proto
        if rest:
            try:
                proto = int(rest[0])
            except ValueError:
                return error("ERR Protocol version is not an integer or out of range")
            if proto not in (2, 3):
                return error("NOPROTO sorry, this protocol version is not supported.")
        options = rest[1:]
        while options:
            option = options[0].upper()
            if option == b"AUTH" and len(options) >= 3:
                if self.settings.auth_enabled:
                    checked = await self._authenticate(conn, options[2])
                    if checked is None:
                        return None
                    if not checked:
                        return error(_WRONGPASS)
                options = options[3:]
            elif option == b"SETNAME" and len(options) >= 2:
                conn.name = bounded_name(options[1])
                options = options[2:]
            else:
                return error(
                    f"ERR Syntax error in HELLO option '{option.decode(errors='replace')}'"
                )
        if conn.scope is None:
            return error(
                "NOAUTH HELLO must be called with the client already authenticated, otherwise"
                " the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the"
                " client and select the RESP protocol version at the same time"
            )
        conn.proto = proto
        return map_reply(
            [
                ("server", "cachekeeper"),
                ("version", "7.4.0"),  # the Redis feature level served (redis-py checks none)
                ("proto", proto),
                ("id", conn.id),
                ("mode", "standalone"),
                ("role", "master"),
                ("modules", []),
            ],
            proto,
        )

    async def _cmd_client(self, conn: _Conn, rest: list[Any]) -> bytes:
        sub = rest[0].upper() if rest else b""
        if sub == b"SETINFO" and len(rest) == 3:
            attr = rest[1].upper()
            if attr == b"LIB-NAME":
                conn.lib_name = bounded_name(rest[2])
            elif attr == b"LIB-VER":
                conn.lib_ver = bounded_name(rest[2])
            else:
                return error(f"ERR Unrecognized option '{bounded_name(attr)}'")
            return simple("OK")
        if sub == b"SETNAME" and len(rest) == 2:
            conn.name = bounded_name(rest[1])
            return simple("OK")
        if sub == b"GETNAME" and len(rest) == 1:
            return bulk(conn.name.encode()) if conn.name else nil(conn.proto)
        if sub == b"ID" and len(rest) == 1:
            return integer(conn.id)
        if sub == b"MAINT_NOTIFICATIONS":
            return simple("OK")  # there is no maintenance to notify of
        return error(f"ERR unknown subcommand '{bounded_name(sub) or '?'}'. Try CLIENT HELP.")

    async def _cmd_select(self, conn: _Conn, rest: list[Any]) -> bytes:
        if len(rest) != 1:
            return error("ERR wrong number of arguments for 'select' command")
        if rest[0] != b"0":
            return error("ERR DB index is out of range (the per-key tier has database 0 only)")
        return simple("OK")

    async def _cmd_ping(self, conn: _Conn, rest: list[Any]) -> bytes:
        if len(rest) > 1:
            return error("ERR wrong number of arguments for 'ping' command")
        return bulk(rest[0]) if rest else simple("PONG")

    async def _cmd_echo(self, conn: _Conn, rest: list[Any]) -> bytes:
        if len(rest) != 1:
            return error("ERR wrong number of arguments for 'echo' command")
        return bulk(rest[0])

    async def _cmd_quit(self, conn: _Conn, rest: list[Any]) -> bytes:
        conn.closing = True
        return simple("OK")

    async def _cmd_command(self, conn: _Conn, rest: list[Any]) -> bytes:
        return b"*0\r\n"  # redis-cli asks for the command table; it works without one

    async def _cmd_get(self, conn: _Conn, rest: list[Any]) -> Reply:
        if len(rest) != 1:
            return error("ERR wrong number of arguments for 'get' command")
        conn.get_started = time.perf_counter()
        key = rest[0]
        if isinstance(key, Dropped) or len(key) > self.settings.remote_cache_max_key_bytes:
            return self._miss(conn, "miss")  # never stored
        # What this reply holds until the client takes it: a value read for it is counted
        # before it is read; a value already held (hot, or waiting to be stored) when sent.
        held = Held(self._output)
        environment = environment_of_client_name(conn.name)
        pending = self._writer.peek(key, environment=environment)
        if pending is not None:
            return self._hit(conn, pending, held)
        read = functools.partial(self.store.fetch, key, environment=environment, reserve=held.take)
        future = self._loop.run_in_executor(self._reads, read)
        try:
            value, why = await asyncio.wait_for(
                asyncio.shield(future), self.settings.remote_cache_get_timeout_s
            )
        except TimeoutError:
            future.add_done_callback(lambda _done: held.give_back())
            return self._miss(conn, "slow")
        except Exception:  # noqa: BLE001 - a store that fails is a miss, never an error reply
            held.give_back()
            _log.exception("per-key tier: reading a value failed")
            return self._miss(conn, "failed")
        if value is None:
            held.give_back()
            return self._miss(conn, "busy" if held.refused else why)
        return self._hit(conn, value, held)

    def _hit(self, conn: _Conn, value: bytes, held: Held) -> Reply:
        if not held.holds(len(value)) and not held.take(len(value)):
            return self._miss(conn, "busy")  # the replies clients have not taken are over budget
        conn.held = held
        self._got(conn, "hit")
        self.metrics.inc("cachekeeper_remote_cache_bytes_total", len(value), direction="out")
        return bulk_parts(value)

    def _miss(self, conn: _Conn, why: str) -> bytes:
        self._got(conn, why)
        return nil(conn.proto)

    def _got(self, conn: _Conn, result: str) -> None:
        """Count a GET by its result and time it from its command to its reply."""
        self.metrics.inc("cachekeeper_remote_cache_gets_total", result=result)
        seconds = time.perf_counter() - conn.get_started
        self.metrics.observe("cachekeeper_remote_cache_get_seconds", seconds, result=result)

    async def _cmd_set(self, conn: _Conn, rest: list[Any]) -> bytes:
        if len(rest) < 2:
            return error("ERR wrong number of arguments for 'set' command")
        problem = expiry_problem(rest[2:])
        if problem is not None:
            return error(problem)
        key, value = rest[0], rest[1]
        reason = None
        if conn.scope not in ("write", "admin"):
            reason = "read_only_token"
        elif not self.settings.remote_cache_writable:
            reason = "signatures_required"
        elif isinstance(key, Dropped) or len(key) > self.settings.remote_cache_max_key_bytes:
            reason = "key_too_long"
        else:
            size = value.length if isinstance(value, Dropped) else len(value)
            if size > self.settings.remote_cache_max_value_bytes:
                reason = "too_large"
            elif isinstance(value, Dropped) or conn.reserved_bytes != queued_bytes(key, size):
                reason = "busy"  # not admitted into the writer's budget (_keep)
            else:
                conn.reserved_bytes = 0  # the writer's from here: offer() queues or releases it
                if not self._writer.offer(key, value, self._writer_of(conn)):
                    reason = "busy"
        if reason is not None:
            self.metrics.inc("cachekeeper_remote_cache_puts_total", result=reason)
        return simple("OK")

    def _writer_of(self, conn: _Conn) -> dict[str, Any]:
        """Who wrote a value: the token (its id, from AUTH: never the name the client
        claims), its scope and the environment its client name gives; the peer, the
        claimed name and the library are kept as hints."""
        return {
            "token": conn.token,
            "scope": conn.scope,
            "environment": environment_of_client_name(conn.name),
            "via": "resp",
            "peer": conn.peer,
            "client": conn.name,
            "lib": f"{conn.lib_name} {conn.lib_ver}".strip(),
        }


_Handler = Callable[[RespServer, _Conn, list[Any]], Any]
_COMMANDS: dict[bytes, _Handler] = {
    b"AUTH": RespServer._cmd_auth,
    b"HELLO": RespServer._cmd_hello,
    b"CLIENT": RespServer._cmd_client,
    b"SELECT": RespServer._cmd_select,
    b"PING": RespServer._cmd_ping,
    b"ECHO": RespServer._cmd_echo,
    b"QUIT": RespServer._cmd_quit,
    b"COMMAND": RespServer._cmd_command,
    b"GET": RespServer._cmd_get,
    b"SET": RespServer._cmd_set,
}
