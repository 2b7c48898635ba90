"""The per-key tier's listener: the subset of the Redis protocol torch's remote caches speak.

torch's FX graph, AOTAutograd, autotune and PGO remote caches reach a server through
redis-py (``torch/_inductor/remote_cache.py``): after redis-py's handshake they send only
``GET key`` and ``SET key value`` (``EX seconds`` on torch main). The handshake, read in
redis-py 7.4 and 8.1 and replayed by ``tests/server/test_resp.py`` with both:

    redis-py 7, password:  AUTH tok; CLIENT SETINFO LIB-NAME ..; CLIENT SETINFO LIB-VER ..
    redis-py 8, password:  HELLO 3 AUTH default tok; CLIENT MAINT_NOTIFICATIONS ON ..;
                           CLIENT SETINFO LIB-NAME ..; CLIENT SETINFO LIB-VER ..
    redis-py 8, none:      HELLO 3; CLIENT MAINT_NOTIFICATIONS ON ..; CLIENT SETINFO ..
    a URL's client_name:   CLIENT SETNAME name;   a URL's /N with N != 0: SELECT N

Served: RESP2 and RESP3 (``HELLO 2|3``), ``AUTH`` (a token as password; a username is
ignored), ``CLIENT SETINFO|SETNAME|GETNAME|ID|MAINT_NOTIFICATIONS``, ``SELECT 0``,
``PING``, ``ECHO``, ``QUIT``, ``COMMAND`` (empty), ``GET``, ``SET`` with or without
``EX``/``PX``; anything else answers ``-ERR``.

The rule that shapes every answer: torch catches only redis-py's ConnectionError, and an
error reply to a ``SET`` (or a rejected ``HELLO``) makes the compile raise. So a GET or a
SET is never answered with an error torch would raise on:

- a SET from a token without the write scope, while the tier is read-only (signatures),
  of a value over the cap, or while the values waiting to be stored are over their
  budget, is answered ``+OK`` and dropped (``cachekeeper_remote_cache_puts_total``
  counts why); accepted values are stored by one writer thread after the answer;
- a GET the store does not answer within ``remote_cache_get_timeout_s`` is answered nil;
- with auth on, a GET or SET before ``AUTH`` is answered ``-NOAUTH`` and a wrong token
  ``-WRONGPASS``: redis-py raises AuthenticationError, a ConnectionError, at once (it does
  not retry it), and torch turns that remote cache off for the process;
- too many connections: ``-ERR max number of clients reached`` (a ConnectionError too);
- garbage on the socket (not RESP, a bulk length out of range) is answered
  ``-ERR Protocol error`` and that connection is closed; no other connection notices.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachekeeper.errors import ConfigInvalid
from cachekeeper.remote_tier import environment_of_client_name

from .auth import scope_of_token, token_id
from .metrics import Metrics
from .settings import Settings
from .tier import TierStore, TierWriter

__all__ = ["RespServer", "MAX_CLIENTS"]

_log = logging.getLogger("cachekeeper.server.resp")

MAX_CLIENTS = 1024
MAX_ARGS = 32
MAX_KEY_BYTES = 64 << 10  # any argument but SET's value; torch's keys are ~100 bytes
MAX_LINE_BYTES = 64 << 10
_DISCARD_CHUNK = 1 << 20
_GET_WORKERS = 8
TLS_HANDSHAKE_TIMEOUT_S = 10.0
_CRLF = b"\r\n"


class ProtocolError(Exception):
    """The client sent something that is not RESP (the connection is closed)."""


@dataclass(frozen=True)
class Dropped:
    """An argument whose bytes were read and discarded (too long to keep)."""

    length: int


@dataclass
class _Conn:
    peer: str
    scope: str | None  # None: not authenticated
    token: str | None = None  # the token's id (auth.token_id) once AUTH accepted one
    proto: int = 2
    name: str = ""
    lib: str = ""
    closing: bool = False
    id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# -- encoding -----------------------------------------------------------------------------


def _simple(text: str) -> bytes:
    return b"+" + text.encode() + _CRLF


def _error(text: str) -> bytes:
    return b"-" + text.replace("\r", " ").replace("\n", " ").encode() + _CRLF


def _bulk(value: bytes) -> bytes:
    return b"".join(_bulk_parts(value))


def _bulk_parts(value: bytes) -> tuple[bytes, bytes, bytes]:
    return b"$%d\r\n" % len(value), value, _CRLF


# A reply is its bytes, or for a value the server sends as it holds it, its parts: a GET's
# value (megabytes) goes out as (header, value, CRLF) through ``writelines`` and is never
# copied into a reply (Python 3.12's transport sends the parts with one sendmsg).
Reply = bytes | tuple[bytes, ...]


def _int(value: int) -> bytes:
    return b":%d\r\n" % value


def _nil(proto: int) -> bytes:
    return b"_\r\n" if proto == 3 else b"$-1\r\n"


def _map(pairs: list[tuple[str, Any]], proto: int) -> bytes:
    """A map in RESP3, its flattened array in RESP2 (HELLO's answer)."""
    out = [b"%" + str(len(pairs)).encode() + _CRLF if proto == 3 else b"*%d\r\n" % (2 * len(pairs))]
    for key, value in pairs:
        out.append(_bulk(key.encode()))
        if isinstance(value, int):
            out.append(_int(value))
        elif isinstance(value, list):
            out.append(b"*0\r\n")
        else:
            out.append(_bulk(str(value).encode()))
    return b"".join(out)


# -- decoding -----------------------------------------------------------------------------


async def _line(reader: asyncio.StreamReader) -> bytes | None:
    try:
        line = await reader.readuntil(_CRLF)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("unexpected end of stream") from exc
    except asyncio.LimitOverrunError as exc:
        raise ProtocolError("line too long") from exc
    return line[:-2]


async def read_command(
    reader: asyncio.StreamReader, *, keep: Callable[[list[Any], int], bool]
) -> list[Any] | None:
    """One command as a list of bytes (``Dropped`` for a bulk ``keep`` refused), or None at
    the end of the stream. ``keep(args so far, length)`` says whether to hold the next bulk.
    Raises ProtocolError on anything that is not RESP."""
    try:
        first = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        return None
    if first != b"*" and not (first.isalpha() or first in b"\r\n"):
        # not RESP (a TLS hello, binary noise): say so now rather than wait for a CRLF
        raise ProtocolError(f"unexpected byte {first!r}")
    if first in b"\r\n":  # a blank line between inline commands
        return []
    rest = await _line(reader)
    if rest is None:
        raise ProtocolError("unexpected end of stream")
    line = first + rest
    if not line.startswith(b"*"):
        if not line.strip():
            return []
        return list(line.split())  # an inline command (telnet, redis-cli -x)
    try:
        count = int(line[1:])
    except ValueError as exc:
        raise ProtocolError("invalid multibulk length") from exc
    if not 0 <= count <= MAX_ARGS:
        raise ProtocolError("invalid multibulk length")
    args: list[Any] = []
    for _ in range(count):
        header = await _line(reader)
        if header is None or not header.startswith(b"$"):
            raise ProtocolError(f"expected '$', got {bytes(header or b'')[:1]!r}")
        try:
            length = int(header[1:])
        except ValueError as exc:
            raise ProtocolError("invalid bulk length") from exc
        if not 0 <= length <= (1 << 32):
            raise ProtocolError("invalid bulk length")
        try:
            if keep(args, length):
                data = await reader.readexactly(length + 2)
                if data[-2:] != _CRLF:
                    raise ProtocolError("bulk not terminated by CRLF")
                args.append(data[:-2])
            else:
                left = length + 2
                while left:
                    left -= len(await reader.readexactly(min(left, _DISCARD_CHUNK)))
                args.append(Dropped(length))
        except asyncio.IncompleteReadError as exc:
            raise ProtocolError("unexpected end of stream") from exc
    return args


# -- the server -----------------------------------------------------------------------------


class RespServer:
    """The tier's listener on ``settings.host``:``settings.resp_port``; ``start()``/``stop()``."""

    def __init__(self, *, store: TierStore, settings: Settings, metrics: Metrics) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.port: int | None = None
        self.clients = 0
        self._next_id = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._reads = concurrent.futures.ThreadPoolExecutor(
            max_workers=_GET_WORKERS, thread_name_prefix="cachekeeper-tier-get"
        )
        self._writer = TierWriter(store, metrics, budget_bytes=settings.remote_cache_pending_bytes)

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
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(
                    self._serve,
                    sock=sock,
                    limit=MAX_LINE_BYTES,
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
            for task in [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]:
                task.cancel()

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
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self.clients >= MAX_CLIENTS:
            writer.write(_error("ERR max number of clients reached"))
            await self._close(writer)
            return
        self.clients += 1
        self._next_id += 1
        anonymous = "admin" if not self.settings.auth_enabled else None
        if anonymous is None and self.settings.anonymous_read:
            anonymous = "anonymous"
        conn = _Conn(peer=str(peer[0]) if peer else "", scope=anonymous, id=self._next_id)
        conn.extra["authed"] = not self.settings.auth_enabled
        try:
            while not conn.closing:
                try:
                    args = await read_command(reader, keep=self._keeper(conn))
                except ProtocolError as exc:
                    self.metrics.inc("cachekeeper_remote_cache_protocol_errors_total")
                    writer.write(_error(f"ERR Protocol error: {exc}"))
                    break
                if args is None:
                    break
                if not args:
                    continue
                reply = await self._dispatch(conn, args)
                if isinstance(reply, tuple):
                    writer.writelines(reply)
                else:
                    writer.write(reply)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.clients -= 1
            await self._close(writer)

    @staticmethod
    async def _close(writer: asyncio.StreamWriter) -> None:
        try:
            await writer.drain()
            writer.close()
            await writer.wait_closed()
        except (ConnectionError, asyncio.CancelledError, RuntimeError):
            pass

    def _keeper(self, conn: _Conn) -> Callable[[list[Any], int], bool]:
        def keep(args: list[Any], length: int) -> bool:
            if len(args) == 2 and isinstance(args[0], bytes) and args[0].upper() == b"SET":
                pending = self._writer.pending_bytes
                return (
                    length <= self.settings.remote_cache_max_value_bytes
                    and pending + length <= self.settings.remote_cache_pending_bytes
                )
            return length <= MAX_KEY_BYTES

        return keep

    async def _dispatch(self, conn: _Conn, args: list[Any]) -> Reply:
        name = args[0].upper() if isinstance(args[0], bytes) else b""
        rest = args[1:]
        handler = _COMMANDS.get(name)
        if handler is None:
            shown = name.decode(errors="replace")[:40] if name else "?"
            return _error(f"ERR unknown command '{shown}', with args beginning with: ")
        if any(isinstance(a, Dropped) for a in rest) and name not in (b"SET", b"GET"):
            return _error("ERR argument too long")
        return await handler(self, conn, rest)

    # -- commands -------------------------------------------------------------------------
    def _authenticate(self, conn: _Conn, password: bytes) -> bool:
        scope = scope_of_token(self.settings, password.decode(errors="replace"))
        if scope is None:
            return False
        conn.scope, conn.extra["authed"] = scope, True
        conn.token = token_id(password.decode(errors="replace"))
        return True

    async def _cmd_auth(self, conn: _Conn, rest: list[Any]) -> bytes:
        if len(rest) not in (1, 2):
            return _error("ERR wrong number of arguments for 'auth' command")
        if not self.settings.auth_enabled:
            return _simple("OK")  # a node with a token, a server without auth: let it in
        if self._authenticate(conn, rest[-1]):
            return _simple("OK")
        self.metrics.inc("cachekeeper_remote_cache_auth_failures_total")
        return _error("WRONGPASS invalid username-password pair or user is disabled.")

    async def _cmd_hello(self, conn: _Conn, rest: list[Any]) -> bytes:
        proto = conn.proto
        if rest:
            try:
                proto = int(rest[0])
            except ValueError:
                return _error("ERR Protocol version is not an integer or out of range")
            if proto not in (2, 3):
                return _error("NOPROTO sorry, this protocol version is not supported.")
        options = rest[1:]
        while options:
            option = options[0].upper() if isinstance(options[0], bytes) else b""
            if option == b"AUTH" and len(options) >= 3:
                if self.settings.auth_enabled and not self._authenticate(conn, options[2]):
                    self.metrics.inc("cachekeeper_remote_cache_auth_failures_total")
                    return _error("WRONGPASS invalid username-password pair or user is disabled.")
                options = options[3:]
            elif option == b"SETNAME" and len(options) >= 2:
                conn.name = options[1].decode(errors="replace")
                options = options[2:]
            else:
                return _error(
                    f"ERR Syntax error in HELLO option '{option.decode(errors='replace')}'"
                )
        if not conn.extra["authed"] and conn.scope is None:
            return _error(
                "NOAUTH HELLO must be called with the client already authenticated, otherwise"
                " the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the"
                " client and select the RESP protocol version at the same time"
            )
        conn.proto = proto
        return _map(
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
        sub = rest[0].upper() if rest and isinstance(rest[0], bytes) else b""
        if sub == b"SETINFO" and len(rest) == 3:
            attr = rest[1].upper()
            if attr == b"LIB-NAME":
                conn.lib = f"{rest[2].decode(errors='replace')} {conn.lib}".strip()
            elif attr == b"LIB-VER":
                conn.lib = f"{conn.lib} {rest[2].decode(errors='replace')}".strip()
            else:
                return _error(f"ERR Unrecognized option '{attr.decode(errors='replace')}'")
            return _simple("OK")
        if sub == b"SETNAME" and len(rest) == 2:
            conn.name = rest[1].decode(errors="replace")
            return _simple("OK")
        if sub == b"GETNAME" and len(rest) == 1:
            return _bulk(conn.name.encode()) if conn.name else _nil(conn.proto)
        if sub == b"ID" and len(rest) == 1:
            return _int(conn.id)
        if sub == b"MAINT_NOTIFICATIONS":
            return _simple("OK")  # there is no maintenance to notify of
        shown = sub.decode(errors="replace") or "?"
        return _error(f"ERR unknown subcommand '{shown}'. Try CLIENT HELP.")

    async def _cmd_select(self, conn: _Conn, rest: list[Any]) -> bytes:
        if len(rest) != 1:
            return _error("ERR wrong number of arguments for 'select' command")
        if rest[0] != b"0":
            return _error("ERR DB index is out of range (the per-key tier has database 0 only)")
        return _simple("OK")

    async def _cmd_ping(self, conn: _Conn, rest: list[Any]) -> bytes:
        if len(rest) > 1:
            return _error("ERR wrong number of arguments for 'ping' command")
        return _bulk(rest[0]) if rest else _simple("PONG")

    async def _cmd_echo(self, conn: _Conn, rest: list[Any]) -> bytes:
        if len(rest) != 1:
            return _error("ERR wrong number of arguments for 'echo' command")
        return _bulk(rest[0])

    async def _cmd_quit(self, conn: _Conn, rest: list[Any]) -> bytes:
        conn.closing = True
        return _simple("OK")

    async def _cmd_command(self, conn: _Conn, rest: list[Any]) -> bytes:
        return b"*0\r\n"  # redis-cli asks for the command table; it works without one

    async def _cmd_get(self, conn: _Conn, rest: list[Any]) -> Reply:
        if len(rest) != 1:
            return _error("ERR wrong number of arguments for 'get' command")
        if not conn.extra["authed"] and conn.scope is None:
            return _error("NOAUTH Authentication required.")
        key = rest[0]
        if isinstance(key, Dropped):
            return self._miss(conn, "miss")
        environment = environment_of_client_name(conn.name)
        pending = self._writer.peek(key, environment=environment)
        if pending is not None:
            return self._hit(pending)
        read = functools.partial(self.store.fetch, key, environment=environment)
        future = self._loop.run_in_executor(self._reads, read)
        try:
            value, why = await asyncio.wait_for(
                asyncio.shield(future), self.settings.remote_cache_get_timeout_s
            )
        except TimeoutError:
            return self._miss(conn, "slow")
        except Exception:  # noqa: BLE001 - a store that fails is a miss, never an error reply
            _log.exception("per-key tier: reading a value failed")
            return self._miss(conn, "failed")
        return self._miss(conn, why) if value is None else self._hit(value)

    def _hit(self, value: bytes) -> Reply:
        self.metrics.inc("cachekeeper_remote_cache_gets_total", result="hit")
        self.metrics.inc("cachekeeper_remote_cache_bytes_total", len(value), direction="out")
        return _bulk_parts(value)

    def _miss(self, conn: _Conn, why: str) -> bytes:
        self.metrics.inc("cachekeeper_remote_cache_gets_total", result=why)
        return _nil(conn.proto)

    async def _cmd_set(self, conn: _Conn, rest: list[Any]) -> bytes:
        if len(rest) < 2:
            return _error("ERR wrong number of arguments for 'set' command")
        options = [o.upper() if isinstance(o, bytes) else b"" for o in rest[2:]]
        if options:
            if len(options) != 2 or options[0] not in (b"EX", b"PX") or not rest[3].isdigit():
                return _error(
                    "ERR syntax error (the per-key tier takes SET key value [EX s|PX ms])"
                )
            if int(rest[3]) <= 0:
                return _error("ERR invalid expire time in 'set' command")
        if not conn.extra["authed"] and conn.scope is None:
            return _error("NOAUTH Authentication required.")
        key, value = rest[0], rest[1]
        reason = None
        if conn.scope not in ("write", "admin"):
            reason = "read_only_token"
        elif not self.settings.remote_cache_writable:
            reason = "signatures_required"
        elif isinstance(key, Dropped) or isinstance(value, Dropped):
            too_big = isinstance(value, Dropped) and (
                value.length > self.settings.remote_cache_max_value_bytes
            )
            reason = "too_large" if too_big or isinstance(key, Dropped) else "busy"
        elif not self._writer.offer(key, value, self._writer_of(conn)):
            reason = "busy"
        if reason is not None:
            self.metrics.inc("cachekeeper_remote_cache_puts_total", result=reason)
        return _simple("OK")

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
            "lib": conn.lib,
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
