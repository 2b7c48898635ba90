"""What every call to the server shares: the server's root URL, and one deadline per operation.

A server URL may carry a user name and password (``http://user:pw@cache:8750``, for a proxy
in front of the server); ``redact_url`` is the form every message, log line and job report
shows, so the password is never echoed on stderr or stored on the server.

Stdlib only: the pre-job hook uses both before it knows whether it needs the HTTP client
(``cachekeeper.client.api``, which re-exports them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit, urlunsplit

from cachekeeper.errors import ServerUnavailable

__all__ = ["Deadline", "read_within", "redact_url", "server_root"]


class Deadline:
    """A point in monotonic time that every call of one operation must finish by."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None for no deadline."""
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    @property
    def expired(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0.0

    def bound(self, timeout_s: float) -> float:
        """``timeout_s`` shortened to what is left; raises ServerUnavailable when nothing is."""
        left = self.remaining()
        if left is None:
            return timeout_s
        if left <= 0.0:
            raise ServerUnavailable(f"gave up after the {self.seconds:g} s deadline")
        return min(timeout_s, left)


def server_root(url: str) -> str:
    """The server URL the client's paths go under: no trailing ``/`` and no ``/v1``.

    Every route path already starts with ``/v1``, so a URL copied from the API docs
    (``http://cache:8750/v1``) would otherwise ask for ``/v1/v1/...``.
    """
    root = url.strip().rstrip("/")
    if root.lower().endswith("/v1"):
        root = root[: -len("/v1")].rstrip("/")
    return root


def redact_url(url: str) -> str:
    """``url`` without its user name and password: ``http://u:pw@cache:8750/v1`` ->
    ``http://cache:8750/v1`` (what messages, logs and reports show)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a server URL that does not parse>"
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def read_within(
    chunks: Iterable[bytes],
    *,
    limit: int,
    deadline: Deadline,
    late: Callable[[int], Exception],
    over: Callable[[], Exception],
) -> bytes:
    """The bytes of ``chunks`` (an answer's body, as it arrives), at most ``limit`` of them
    and never past ``deadline``: raises ``late(bytes read so far)`` once the deadline has
    passed, ``over()`` past the limit. A server trickling a byte a second cannot hold a
    read past the deadline, one sending gigabytes cannot fill the memory."""
    parts: list[bytes] = []
    total = 0
    for chunk in chunks:
        if deadline.expired:
            raise late(total)
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise over()
    return b"".join(parts)  # one copy: at most twice the limit is ever held
