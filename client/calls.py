"""The rules every request of the client side follows, in one place: URLs, TLS, headers,
deadlines, answer sizes, and the one retry rule. ``client/transport.py`` applies them to
each request (httpx for ``CacheClient`` and the object store, ``http.client`` for the hook).

- ``endpoint(server, path)`` is the one place a route's URL is built, for every client path:
  ``CacheClient`` (httpx), the hook's quick resolve and the job reports (``http.client``).
  The server URL may end in ``/`` or ``/v1`` (as copied from the API docs), and may have a
  path prefix (a reverse proxy serving the API under ``/cachekeeper``).
- ``tls_context()`` is the one TLS context of every ``https://`` request: the default CAs
  (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set, else certifi's bundle when installed, as
  httpx does, else the system's), plus the CAs of ``$CACHEKEEPER_CA_BUNDLE``
  (``--ca-bundle``), e.g. a site's private CA behind its reverse proxy.
- ``request_headers(token=...)`` are the headers every request sends: the User-Agent, and
  to the server the bearer token (never to the object store: its URLs carry their own
  signature, and the server's token is not the store's).
- ``Deadline`` is one point in time that every request of an operation ends by, retries
  and the reading of answers included; ``read_within`` reads an answer against it and a
  size cap (``*_MAX_BYTES``), so a server trickling a byte a second cannot hold a call past
  it and one sending gigabytes cannot fill the memory.
- ``Backoff`` is the one retry rule (huggingface_hub's ``http_backoff``): a request that
  failed on the way or got an answer in ``RETRY_STATUSES`` is sent again, after a jittered
  exponential wait, a bounded number of times, never past the deadline.

A server URL may carry a user name and password (``http://user:pw@cache:8750``, for a proxy
in front of the server); ``redact_url`` is the form every message, log line and job report
shows, so the password is never echoed on stderr or stored on the server.

- ``refuse_plaintext(url, token=..., allow=...)`` is the one plaintext rule of every client
  path that sends a credential (``CacheClient``'s httpx client, the hook's ``post_json``,
  the per-key tier's URL): a bearer token, or a password in the URL, never travels over
  plain ``http://`` to a host that is not loopback (``localhost``, 127.0.0.0/8, ``::1``)
  unless ``allow`` (``--allow-plaintext``, ``$CACHEKEEPER_ALLOW_PLAINTEXT``:
  ``plaintext_allowed``). Anyone on the path would read it, and with it write cache bytes
  every node then runs. Presigned object-store URLs carry no token and are exempt.
- ``tls_hint(url, text)`` is the advice a failed request's message ends with when the
  failure says TLS is wrong: ``http://`` to a server that speaks TLS ("use https://"),
  ``https://`` to one that does not ("use http://"), a certificate no trusted CA signed
  ("--ca-bundle"). ``speaks_tls`` asks the port itself, once, on the error path only.

Stdlib only: the pre-job hook uses them before it knows whether it needs the HTTP client
(``cachekeeper.client.api``, which re-exports ``Deadline`` and ``server_root``).
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from cachekeeper import config
from cachekeeper.errors import ConfigInvalid, PlaintextRefused, ServerUnavailable

if TYPE_CHECKING:
    import ssl

__all__ = [
    "ANSWER_MAX_BYTES",
    "MANIFEST_MAX_BYTES",
    "RESOLVE_MAX_BYTES",
    "RETRY_STATUSES",
    "USER_AGENT",
    "Backoff",
    "Deadline",
    "endpoint",
    "is_loopback_host",
    "plaintext_allowed",
    "read_within",
    "redact_url",
    "plaintext_reason",
    "refuse_plaintext",
    "request_headers",
    "server_root",
    "speaks_tls",
    "tls_context",
    "tls_hint",
]

USER_AGENT = "cachekeeper-client"
# The most bytes an answer read whole may have: a server that sends more is refused, so
# the hook's memory stays bounded whatever it is sent.
ANSWER_MAX_BYTES = 64 << 20
MANIFEST_MAX_BYTES = 512 << 20  # 200,000 files are about 50 MB of manifest
RESOLVE_MAX_BYTES = 16 << 20  # a resolve answer is kilobytes (the hook's POSTs too)
# Answers worth another try: the server or a proxy in front of it is briefly unwell.
RETRY_STATUSES = frozenset({500, 502, 503, 504})


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


class Backoff:
    """The one retry rule of every client path: ``retries`` more tries at most, the k-th
    after ``base_s * 2**k`` seconds (at most ``max_s``), jittered to between half and all
    of it so that the nodes of a job do not retry in step, and only while the deadline
    leaves more than that wait. What is retried: a request that failed on the way
    (refused, reset, timed out) and an answer in ``RETRY_STATUSES``.

    A value, never changed after it is made (a plain class, as ``Deadline``: the hook's
    no-op path imports this module, and making a frozen dataclass costs it a millisecond).
    """

    __slots__ = ("base_s", "max_s", "retries")

    def __init__(self, *, retries: int = 3, base_s: float = 0.2, max_s: float = 2.0) -> None:
        self.retries = retries
        self.base_s = base_s
        self.max_s = max_s

    def __repr__(self) -> str:
        return f"Backoff(retries={self.retries}, base_s={self.base_s}, max_s={self.max_s})"

    def wait(self, retry: int, deadline: Deadline) -> bool:
        """Sleep before retry ``retry + 1`` (0 is the first); False, without sleeping, when
        the retries or the deadline's time are used up."""
        if retry >= self.retries:
            return False
        delay = min(self.base_s * (2**retry), self.max_s) * (0.5 + random.random() / 2)
        left = deadline.remaining()
        if left is not None and left <= delay:
            return False
        time.sleep(delay)
        return True


def request_headers(*, token: str | None = None) -> dict[str, str]:
    """The headers of every request: the User-Agent and, to the server, the bearer token."""
    headers = {"User-Agent": USER_AGENT}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


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


def redact_url(url: str, *, query: bool = True) -> str:
    """``url`` without its user name and password: ``http://u:pw@cache:8750/v1`` ->
    ``http://cache:8750/v1`` (what messages, logs and reports show). ``query=False`` drops
    the query too: a presigned URL's signature is not for logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a server URL that does not parse>"
    if query and "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    if not query:
        return urlunsplit((parts.scheme, host, parts.path, "", ""))
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


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ``::1``), as written:
    a host name is never resolved (it may resolve anywhere, and resolving costs time)."""
    import ipaddress  # only when a credential would travel over http: the hook's budget

    name = host.strip().strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def plaintext_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``--allow-plaintext`` / ``$CACHEKEEPER_ALLOW_PLAINTEXT`` is given."""
    return config.allow_plaintext(os.environ if environ is None else environ)


def plaintext_reason(url: str, *, token: str | None, allow: bool) -> str | None:
    """Why a request to ``url`` must not send ``token`` (or the URL's own password): one
    line, or None. A token goes over plain ``http://`` (or the tier's ``redis://``) only to
    a loopback host, or when ``allow`` (``--allow-plaintext`` /
    ``CACHEKEEPER_ALLOW_PLAINTEXT``). Any other URL passes."""
    if allow:
        return None
    try:
        parts = urlsplit(url.strip())
        host, password = parts.hostname or "", parts.password
    except ValueError:
        return None  # not a URL: the request itself says so
    if parts.scheme.lower() not in ("http", "redis") or not (token or password):
        return None
    if is_loopback_host(host):
        return None
    what = "the bearer token" if token else "the password in the URL"
    secure = "https://" if parts.scheme.lower() == "http" else "rediss:// (serve --tls-cert)"
    return (
        f"refusing to send {what} to {redact_url(url)} in clear text ({host} is not a"
        f" loopback address): use {secure} or --allow-plaintext"
        f" ({config.ALLOW_PLAINTEXT}=1)"
    )


def refuse_plaintext(url: str, *, token: str | None, allow: bool) -> None:
    """Raise ``PlaintextRefused`` when a request to ``url`` would send ``token`` (or the
    URL's own password) in clear text to a host that is not loopback, unless ``allow``
    (``plaintext_reason``; see the module docstring)."""
    reason = plaintext_reason(url, token=token, allow=allow)
    if reason is not None:
        raise PlaintextRefused(reason, extra={"host": urlsplit(url.strip()).hostname or ""})


def speaks_tls(host: str, port: int, *, timeout_s: float = 2.0) -> bool:
    """True when ``host:port`` completes a TLS handshake (certificate not checked: only
    whether the port speaks TLS). Asked once, after a plain-http request failed."""
    import socket
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            with context.wrap_socket(sock, server_hostname=host or None):
                return True
    except (OSError, ValueError):
        return False


def tls_hint(url: str, text: str, *, timeout_s: float = 2.0) -> str:
    """The advice for a request to ``url`` that failed with ``text`` (its error), or ``""``
    (see the module docstring). A plain-http request that the server cut off (not one that
    timed out or was refused) asks the port whether it speaks TLS, within ``timeout_s``."""
    try:
        parts = urlsplit(url)
        scheme, host = parts.scheme.lower(), parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        return ""
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            f"; the certificate of {host} is not signed by a CA this client trusts: pass"
            f" --ca-bundle PEM (or set {config.CA_BUNDLE}) with the CA that signed it"
        )
    if scheme == "https" and ("WRONG_VERSION_NUMBER" in text or "record layer" in text):
        return f"; {host}:{port} does not speak TLS: use http:// instead of https://"
    cut_off = not any(word in text.lower() for word in ("timed out", "timeout", "refused"))
    if (
        scheme == "http"
        and cut_off
        and timeout_s > 0
        and speaks_tls(host, port, timeout_s=timeout_s)
    ):
        return f"; {host}:{port} speaks TLS: use https://{parts.netloc.rpartition('@')[2]}"
    return ""
