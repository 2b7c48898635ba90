"""What a peer of the per-key tier's listener can cost the server, and the bounds on it.

The listener (``server/resp/listener.py``) lives in the process that serves the HTTP API. Before
issue 32 an unauthenticated peer could make it hold 1 GB (eight stalled 128 MiB SETs, read
before auth with no frame timeout), take every descriptor with idle connections (so
``/healthz`` stopped answering and real nodes were locked out), and try ~11,000 tokens a
second on one connection. The bounds, each owned by one piece here:

- **Frames** (``PREAUTH``, ``AUTHED``, read by ``resp_protocol.read_rest``): before auth, a
  command has at most 10 arguments and 16 KiB, as Redis's own limits for unauthenticated
  clients; after auth, 32 arguments and 64 KiB besides a SET's value, which is admitted
  only for a token that may write and only within the writer's budget of bytes waiting.
- **Connections** (``Clients``): at most ``cap`` at once, the listener's share of the
  server's descriptor budget (``connections.connection_budget``), so neither listener can
  take the other's descriptors. At the cap, a new connection closes the oldest one still
  unauthenticated, else the one idle longest (redis-py reconnects on its next command); only
  when every connection is in the middle of a command is the new one refused.
- **Failed auth** (``AuthThrottle``): each failure makes the next attempt from that peer
  address (an IPv6 /64) wait longer, up to ``MAX_DELAY_S``, so guesses from one address are
  spaced at least that far apart whatever the number of connections; an attempt that would
  wait more than ``MAX_WAIT_S`` is not checked (its connection closes, which redis-py reads
  as a ConnectionError, never as the TimeoutError torch does not catch). A connection is
  closed after ``MAX_FAILURES_PER_CONNECTION`` failures. The peer table holds at most
  ``MAX_PEERS`` addresses (least recently failed out) and forgets one after ``FORGET_S``.
- **Output** (``ByteBudget``, one ``Held`` per GET): the values of GET replies that
  clients have not taken yet, counted whole from before a value is read from the store (or,
  for one already in memory, from before it is written) until the client took the reply;
  past the budget a GET is answered nil (a miss), so unread replies cannot pin memory (12
  unread GETs pinned 736 MB before). A value is sent a chunk at a time, so the transport
  never holds a copy of more than a chunk beside it.

The timeouts (auth, idle, frame) are settings the listener applies around its reads.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .protocol import FrameLimits

__all__ = [
    "AUTHED",
    "MAX_DELAY_S",
    "MAX_FAILURES_PER_CONNECTION",
    "MAX_PEERS",
    "MAX_WAIT_S",
    "NAME_BYTES",
    "PREAUTH",
    "AuthThrottle",
    "ByteBudget",
    "Clients",
    "Held",
    "bounded_name",
    "peer_key",
]

PREAUTH = FrameLimits(max_args=10, command_bytes=16 << 10, strict=True)
AUTHED = FrameLimits(max_args=32, command_bytes=64 << 10, strict=False)
NAME_BYTES = 128  # a client name, a library name or version, as kept for a key's writer


def bounded_name(value: bytes) -> str:
    """A client, library or version name as kept for a key's writer: ``NAME_BYTES`` at most."""
    return value[:NAME_BYTES].decode(errors="replace")


BASE_DELAY_S = 0.05
MAX_DELAY_S = 0.5
MAX_WAIT_S = 1.0  # under prejob's 2 s socket timeout: an answer or a close, never a timeout
MAX_FAILURES_PER_CONNECTION = 8
FORGET_S = 60.0
MAX_PEERS = 4096


# -- connections ----------------------------------------------------------------------------


class Clients:
    """The listener's connections, at most ``cap``; what closes at the cap (module docstring).

    The listener says when a member authenticates, goes idle (waits for a command) or
    starts a command (busy: never closed to make room); ``evict(member)`` closes one.
    """

    def __init__(self, cap: int, *, evict: Callable[[Any], None]) -> None:
        self.cap = cap
        self._evict = evict
        self._unauthenticated: OrderedDict[Any, None] = OrderedDict()  # oldest first
        self._idle: OrderedDict[Any, None] = OrderedDict()  # idle longest first
        self._members: set[Any] = set()

    def __len__(self) -> int:
        return len(self._members)

    def admit(self, conn: Any, *, authenticated: bool) -> bool:
        """Add ``conn``; at the cap, evict a member to make room. False: refused, since
        every member is in the middle of a command."""
        if len(self._members) >= self.cap:
            victim = next(iter(self._unauthenticated), None) or next(iter(self._idle), None)
            if victim is None:
                return False
            self.remove(victim)
            self._evict(victim)
        self._members.add(conn)
        if not authenticated:
            self._unauthenticated[conn] = None
        return True

    def authenticated(self, conn: Any) -> None:
        self._unauthenticated.pop(conn, None)

    def idle(self, conn: Any) -> None:
        """``conn`` waits for its next command (closed first-come at the cap)."""
        if conn in self._members and conn not in self._unauthenticated:
            self._idle[conn] = None
            self._idle.move_to_end(conn)

    def busy(self, conn: Any) -> None:
        """``conn`` is in a command: it is not closed to make room."""
        self._idle.pop(conn, None)

    def remove(self, conn: Any) -> None:
        self._members.discard(conn)
        self._unauthenticated.pop(conn, None)
        self._idle.pop(conn, None)


# -- failed auth ---------------------------------------------------------------------------


def peer_key(address: str) -> str:
    """The throttle's name for a peer: its IPv4 address, or its IPv6 /64."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _delay(failures: int) -> float:
    return 0.0 if failures <= 0 else min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (failures - 1))


@dataclass
class _Peer:
    failures: int = 0
    failed_at: float = 0.0
    next_at: float = 0.0  # when this peer's next attempt may be checked


class AuthThrottle:
    """Failed-auth backoff per peer address and per connection (module docstring).
    Used from the listener's event loop only."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._peers: OrderedDict[str, _Peer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._peers)

    def wait_s(self, peer: str, *, connection_failures: int) -> float | None:
        """How long this attempt waits before its token is checked; None: too many
        attempts from ``peer`` are waiting, so it is not checked (close the connection)."""
        now = self._clock()
        own = _delay(connection_failures)
        entry = self._peers.get(peer_key(peer))
        if entry is None or entry.failures == 0:
            return own
        if now - entry.failed_at > FORGET_S:
            del self._peers[peer_key(peer)]
            return own
        at = max(now, entry.next_at)
        if at - now > MAX_WAIT_S:
            return None
        entry.next_at = at + _delay(entry.failures)
        return max(at - now, own)

    def failed(self, peer: str) -> None:
        key = peer_key(peer)
        entry = self._peers.pop(key, None)
        if entry is None:
            entry = _Peer()
            while len(self._peers) >= MAX_PEERS:
                self._peers.popitem(last=False)
        entry.failures += 1
        entry.failed_at = self._clock()
        entry.next_at = max(entry.next_at, entry.failed_at + _delay(entry.failures))
        self._peers[key] = entry  # most recently failed last


# -- output --------------------------------------------------------------------------------


class ByteBudget:
    """Bytes held across connections and threads, at most ``limit`` (one holder may
    always take, so a value over the limit is still served when it is alone)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, size_bytes: int) -> bool:
        with self._lock:
            if self.used and self.used + size_bytes > self.limit:
                return False
            self.used += size_bytes
            return True

    def give(self, size_bytes: int) -> None:
        with self._lock:
            self.used -= size_bytes


class Held:
    """One GET's share of a ``ByteBudget``: ``take`` (asked by the store, in a reading
    thread, before it reads a value into memory) and ``give_back`` (idempotent)."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self._size = 0
        self.refused = False
        self._lock = threading.Lock()

    def take(self, size_bytes: int) -> bool:
        with self._lock:
            if not self._budget.take(size_bytes):
                self.refused = True
                return False
            self._size += size_bytes
            return True

    def holds(self, size_bytes: int) -> bool:
        """Whether ``size_bytes`` are taken already (the store read the value for it)."""
        with self._lock:
            return self._size >= size_bytes

    def give_back(self) -> None:
        with self._lock:
            size, self._size = self._size, 0
        if size:
            self._budget.give(size)
