"""Bounds on connections, before any request exists: header time, how many, open files.

``limits.RequestLimits`` bounds request bodies, but a client can hold a connection without
ever finishing its headers, and uvicorn has no bound on that: 1,100 connections sending a
header byte every 5 s, unauthenticated, used up a 1,024 open-file limit and the server
stopped answering anything. So ``serve`` runs uvicorn with ``bounded_protocol``, its h11
protocol with three additions:

- **Header time.** A request's headers (the first request's, or the next one's on a kept
  -alive connection, from its first byte) must be complete within ``header_timeout_s``,
  or the connection is closed. A connection that sends nothing is uvicorn's keep-alive
  timeout's, as before; a new one that never sends a byte is closed at the header timeout.
- **A cap below the open-file limit.** At most ``max_connections`` connections at once.
  When a new one would pass the cap, the oldest connection that is waiting for headers
  (a slow sender, or an idle kept-alive one) is closed to make room; only when every
  connection is busy with a request is the new one refused (closed at once). So a slow
  client cannot lock out ``/healthz``, a resolve or a prejob: their headers arrive in one
  packet and they are served.
- **The open-file limit raised** where allowed (``raise_open_file_limit``: the soft limit
  up to the hard one), and the default cap derived from it, leaving ``RESERVED_FILES`` for
  what the server itself opens (SQLite connections and their WAL files per worker thread,
  blobs being read, uploads' temp files).

Settings: ``header_timeout_s`` (default 10 s) and ``max_connections`` (default: the open
-file limit less ``RESERVED_FILES``, at most ``MAX_CONNECTIONS``).

**One descriptor budget for both listeners.** The per-key tier's listener
(``server/resp/listener.py``) runs in the same process, so its connections spend the same
descriptors: 1,100 idle RESP connections once took all of them and ``/healthz`` stopped
answering. ``connection_budget`` splits one budget, the open-file limit less
``RESERVED_FILES``, between the two. A cap is enforced once a connection is accepted, and
asyncio accepts up to its listen backlog in one go before any of them is looked at, so
each listener first gets its backlog (a quarter of its part of the budget, at most
``ACCEPT_BATCH``: with 1,024 files, uvicorn's default of 2,048 let one burst take every
descriptor for a moment), then its cap from the rest: with the tier on, its own share
(``max_connections`` for HTTP, ``remote_cache_max_connections`` for RESP; by default half
each, at most ``MAX_CONNECTIONS`` each), and when the two settings together ask for more
than the rest, each is scaled down to its proportional part. Each listener enforces only
its own share, so a flood on one port cannot take the other's descriptors, and the
reserve stays for the catalog and blob files.

**uvicorn's private surface.** uvicorn has no public setting for a header timeout or a
cap that evicts, so ``BoundedH11`` subclasses ``uvicorn.protocols.http.h11_impl.H11Protocol``,
which is not uvicorn's API. What it relies on is ``H11_HOOKS`` (the four methods it
overrides, each calling the original: asyncio calls three, uvicorn's request cycle calls
``on_response_complete`` when a response is sent) and ``H11_ATTRIBUTES`` (set by
``H11Protocol.__init__``: ``connections``, the server's set of open connections;
``conn``, the ``h11.Connection`` whose ``their_state`` says whether a request's headers
are in; ``transport``; ``loop``); and the public ``uvicorn.Config(http=a protocol class,
backlog=...)``. That surface was read in every uvicorn release pyproject.toml admits
(``uvicorn>=0.29,<0.55``: 0.29.0 to 0.54.0); a release past the bound is admitted only
once read again and its tests pass. ``bounded_protocol`` checks the hooks before a server
starts (``check_h11_protocol``), so an uvicorn installed past the bound that lost one
fails loudly at ``serve`` instead of silently not bounding; tests/server/test_connections.py
checks the whole surface on the installed uvicorn and the bounds on a real one.
"""

from __future__ import annotations

import asyncio
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from cachekeeper.errors import ConfigInvalid

from .settings import Settings

__all__ = [
    "ACCEPT_BATCH",
    "MAX_CONNECTIONS",
    "RESERVED_FILES",
    "bounded_http",
    "bounded_protocol",
    "connection_budget",
    "connection_cap",
    "ConnectionBudget",
    "H11_ATTRIBUTES",
    "H11_HOOKS",
    "check_h11_protocol",
    "raise_open_file_limit",
]

RESERVED_FILES = 256  # the server's own files: SQLite (+ WAL, SHM) per thread, blobs, temps
MAX_CONNECTIONS = 4096  # the default cap's ceiling, however high the open-file limit
ACCEPT_BATCH = 511  # a listener's listen backlog at most (Redis's and nginx's default)


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit where allowed; the
    soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass  # not allowed here: the cap below still keeps us under the soft limit
    return soft


@dataclass(frozen=True)
class ConnectionBudget:
    """How many connections each listener holds at once, and accepts in one go (its listen
    backlog), out of one descriptor budget."""

    open_files: int
    http: int
    resp: int  # 0: no tier
    backlog: int  # each listener's listen backlog: asyncio accepts that many in one go


def connection_budget(settings: Settings, *, open_files: int) -> ConnectionBudget:
    """Split the open-file limit less ``RESERVED_FILES`` between HTTP and the tier's RESP
    listener (see the module docstring): each gets its backlog, then its share of the rest."""
    available = max(64, open_files - RESERVED_FILES)
    listeners = 1 if settings.resp_port is None else 2
    backlog = max(16, min(ACCEPT_BATCH, available // (4 * listeners)))
    room = available - listeners * backlog
    if settings.resp_port is None:
        wanted = settings.max_connections or MAX_CONNECTIONS
        http = max(16, min(wanted, room))
        return ConnectionBudget(open_files=open_files, http=http, resp=0, backlog=backlog)
    http = settings.max_connections or min(MAX_CONNECTIONS, room // 2)
    resp = settings.remote_cache_max_connections or min(MAX_CONNECTIONS, room // 2)
    if http + resp > room:  # more than the descriptors allow: each its proportional part
        http, resp = http * room // (http + resp), resp * room // (http + resp)
    return ConnectionBudget(
        open_files=open_files, http=max(16, http), resp=max(16, resp), backlog=backlog
    )


def connection_cap(settings: Settings, *, open_files: int) -> int:
    """How many HTTP connections the server holds at once (``connection_budget``'s share)."""
    return connection_budget(settings, open_files=open_files).http


# What BoundedH11 relies on in uvicorn's H11Protocol (the module docstring says why).
H11_HOOKS = ("connection_made", "data_received", "on_response_complete", "connection_lost")
H11_ATTRIBUTES = ("connections", "conn", "transport", "loop")


def check_h11_protocol(protocol: type = H11Protocol) -> None:
    """ConfigInvalid, naming uvicorn's version, when ``protocol`` lacks a hook BoundedH11
    overrides (an uvicorn past pyproject.toml's bound, where it was renamed or removed)."""
    missing = [name for name in H11_HOOKS if not callable(getattr(protocol, name, None))]
    if missing:
        raise ConfigInvalid(
            f"uvicorn {uvicorn.__version__}: its H11Protocol has no {', '.join(missing)},"
            " which the header timeout and the connection cap (server/connections.py)"
            " override; install the uvicorn cachekeeper[server] asks for (>=0.29,<0.55)"
        )


def bounded_protocol(*, header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the header timeout and the connection cap (one class
    per server: the connections waiting for headers are kept in its registry)."""
    check_h11_protocol()
    waiting: OrderedDict[Any, None] = OrderedDict()  # connections waiting for headers, oldest first

    class BoundedH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections and not self._make_room():
                transport.close()  # every connection is busy with a request: refuse this one
                return
            self._wait_for_headers()

        def _make_room(self) -> bool:
            """Close the oldest connection that is waiting for headers; False when none is."""
            for other in waiting:
                if other is not self:
                    other._drop()
                    return True
            return False

        def _wait_for_headers(self) -> None:
            waiting[self] = None
            waiting.move_to_end(self)
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _headers_done(self) -> None:
            waiting.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE:
                self._drop()

        def _drop(self) -> None:
            waiting.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and self._header_timer is None:
                self._wait_for_headers()  # a kept-alive connection's next request began
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._headers_done()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                waiting[self] = None  # idle and kept alive: evictable, keep-alive timer runs
                waiting.move_to_end(self)

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            super().connection_lost(exc)

    return BoundedH11


def bounded_http(settings: Settings) -> dict[str, Any]:
    """The uvicorn options ``serve`` runs with: the open-file limit raised and the bounded
    protocol (``uvicorn.run(app, ..., **bounded_http(settings))``)."""
    budget = connection_budget(settings, open_files=raise_open_file_limit())
    return {
        "http": bounded_protocol(
            header_timeout_s=settings.header_timeout_s, max_connections=budget.http
        ),
        "backlog": budget.backlog,
    }
