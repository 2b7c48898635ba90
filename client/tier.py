"""The hook's side of the per-key tier: what a job exports for it, after one probe.

``tier_exports`` turns resolve's ``remote_cache`` offer into the job's variables
(``cachekeeper.remote_tier.job_environ``: which switches, and the URL with the node's
token, socket and connect timeouts and a client name). Before a job is pointed at the
tier, ``probe`` proves that its port answers here, now: a TCP connect, ``AUTH`` with the
token, ``PING``, all within ``PROBE_TIMEOUT_S``. torch turns a refused connection into
"no remote cache", but a port that a firewall drops, or a server that accepts and never
answers, would make redis-py raise its TimeoutError, which torch does not catch on an
AOTAutograd put; a job whose probe fails runs with the switches in torch's keys only,
pointed nowhere. Stdlib only: the hook starts fast.
"""

from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from cachekeeper import remote_tier
from cachekeeper.wire import RemoteCacheOffer

__all__ = ["PROBE_TIMEOUT_S", "TierChoice", "probe", "tier_exports"]

PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class TierChoice:
    """What the hook decided: the variables to export and, when the job does not use the
    tier although the server offers it, why (one line)."""

    exports: dict[str, str]
    used: bool
    writable: bool = False
    reason: str | None = None


def _command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def probe(
    host: str, port: int, *, token: str | None, timeout_s: float = PROBE_TIMEOUT_S
) -> str | None:
    """None when the tier at ``host:port`` accepts ``token`` and answers PING within
    ``timeout_s``; else why not, in a few words."""
    payload = (_command(b"AUTH", token.encode()) if token else b"") + _command(b"PING")
    want = (b"+OK\r\n" if token else b"") + b"+PONG\r\n"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(payload)
            got = b""
            while len(got) < len(want) and (chunk := sock.recv(256)):
                got += chunk
                if got.startswith(b"-"):
                    break
    except TimeoutError:
        return f"port {port} did not answer within {timeout_s:g} s"
    except OSError as exc:
        return f"port {port}: {exc.strerror or exc}"
    if got.startswith(b"-WRONGPASS") or got.startswith(b"-NOAUTH"):
        return "the tier refused the token"
    if not got.startswith(want):
        return f"port {port} does not speak the Redis protocol ({got[:20]!r})"
    return None


def tier_exports(
    offer: RemoteCacheOffer | None,
    *,
    server: str,
    token: str | None,
    wish: str,
    client_name: str,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> TierChoice:
    """The job's variables for ``offer`` (None: the server serves no tier: none)."""
    if offer is None:
        return TierChoice(exports={}, used=False)
    reason = None
    if wish == "off":
        reason = "--no-remote-cache"
    elif not offer.use:
        reason = "off by the server's default (prejob --remote-cache turns it on)"
    elif importlib.util.find_spec("redis") is None:
        reason = "redis-py is not installed here (pip install redis)"
    else:
        host = urlsplit(server).hostname or "localhost"
        reason = probe(host, offer.port, token=token, timeout_s=timeout_s)
    if reason is not None:
        return TierChoice(
            exports=remote_tier.job_environ(offer.switches, url=None), used=False, reason=reason
        )
    url = remote_tier.tier_url(server, port=offer.port, token=token, name=client_name)
    return TierChoice(
        exports=remote_tier.job_environ(offer.switches, url=url), used=True, writable=offer.writable
    )
