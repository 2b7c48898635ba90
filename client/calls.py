"""What every call to the server shares: its URLs, the TLS context, one deadline per operation.

- ``endpoint(server, path)`` is the one place a route's URL is built, for every client path:
  ``CacheClient`` (httpx), the hook's quick resolve and the job reports (``http.client``).
  The server URL may end in ``/`` or ``/v1`` (as copied from the API docs), and may have a
  path prefix (a reverse proxy serving the API under ``/cachekeeper``).
- ``tls_context()`` is the one TLS context of every ``https://`` request: the default CAs
  (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set, else certifi's bundle when installed, as
  httpx does, else the system's), plus the CAs of ``$CACHEKEEPER_CA_BUNDLE``
  (``--ca-bundle``), e.g. a site's private CA behind its reverse proxy.

A server URL may carry a user name and password (``http://user:pw@cache:8750``, for a proxy
in front of the server); ``redact_url`` is the form every message, log line and job report
shows, so the password is never echoed on stderr or stored on the server.

Stdlib only: the pre-job hook uses them before it knows whether it needs the HTTP client
(``cachekeeper.client.api``, which re-exports them).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from cachekeeper import config
from cachekeeper.errors import ConfigInvalid, ServerUnavailable

if TYPE_CHECKING:
    import ssl

__all__ = ["Deadline", "endpoint", "read_within", "redact_url", "server_root", "tls_context"]


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


def endpoint(server: str, path: str) -> str:
    """The URL of route ``path`` (``/v1/resolve``, ``/healthz``) on ``server``."""
    return server_root(server) + "/" + path.lstrip("/")


def tls_context(environ: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """The TLS context of every ``https://`` request (see the module docstring).

    A CA bundle that cannot be read is ``ConfigInvalid`` naming the file and the variable.
    Built once per process for each set of inputs (loading CAs costs tens of ms).
    """
    env = os.environ if environ is None else environ
    return _tls_context(
        config.ca_bundle(env), env.get("SSL_CERT_FILE") or None, env.get("SSL_CERT_DIR") or None
    )


@functools.lru_cache(maxsize=4)
def _tls_context(bundle: str | None, cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    import ssl  # only for https: ~18 ms the hook's plain-http no-op path does not pay

    try:
        if cert_file or cert_dir:
            context = ssl.create_default_context(cafile=cert_file, capath=cert_dir)
        else:
            try:
                import certifi  # httpx's own default; installed with it
            except ImportError:  # pragma: no cover - httpx depends on certifi
                context = ssl.create_default_context()
            else:
                context = ssl.create_default_context(cafile=certifi.where())
    except (OSError, ssl.SSLError) as exc:
        where = cert_file or cert_dir
        raise ConfigInvalid(f"SSL_CERT_FILE/SSL_CERT_DIR {where}: cannot load CAs: {exc}") from exc
    if bundle:
        try:
            context.load_verify_locations(cafile=bundle)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigInvalid(
                f"--ca-bundle / {config.CA_BUNDLE} {bundle}: cannot load CAs from it: {exc}"
            ) from exc
    return context


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
