"""The hook's side of the per-key tier: which path a job takes to it, and what it exports.

``tier_exports`` turns resolve's ``remote_cache`` offer into the job's variables. Two paths:

- **cachekeeper's backend** (``--tier-backend cachekeeper``; ``auto`` picks it when the
  server serves the tier over HTTP and the node's torch is a version the backend was
  checked against, ``CHECKED_TORCH``): ``PYTHONPATH`` starts with ``cachekeeper/_tier_hook``,
  whose ``sitecustomize`` installs the backend in every Python process of the job when torch
  imports its remote caches; ``CACHEKEEPER_TIER_*`` name the server, a 0600 file holding the
  token (never its value in an export), the node's environment, whether the job writes, the
  per-call deadline and where each process leaves its counts for postjob. No redis-py, one
  deadline per call, a circuit breaker: a tier that dies mid-job costs it one deadline.
  ``TORCHINDUCTOR_REDIS_URL`` points nowhere (``OFF_URL``), so a process in which the hook
  could not install falls back to no tier, never to a redis-py that may hang.
- **torch's stock redis-py path** (``redis``; ``auto`` for another torch, or an old server):
  the URL of the RESP port with the token, socket and connect timeouts and a client name,
  after a probe of the port (connect, ``AUTH``, ``PING`` within ``PROBE_TIMEOUT_S``). Its
  risk, in prejob's line and docs/server.md: redis-py's TimeoutError is not caught by torch,
  so a tier that stops answering mid-compile can still fail that compile.

Either way the job is off the tier (the key-relevant switches still exported, pointed
nowhere, so snapshots built with them hit) when: the job asked so, the node trusts signing
keys (tier values are unsigned: ``trusted``), or the token would cross the network in
clear (``calls.plaintext_reason``). ``TierChoice.note`` is prejob's one line. Stdlib only:
the hook starts fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cachekeeper import config, remote_tier
from cachekeeper.fsutil import atomic_write_bytes
from cachekeeper.wire import RemoteCacheOffer

from .calls import plaintext_reason, server_root, tls_context

__all__ = [
    "BACKENDS",
    "CHECKED_TORCH",
    "HOOK_DIR",
    "PROBE_TIMEOUT_S",
    "TierChoice",
    "probe",
    "tier_exports",
    "write_token_file",
]

PROBE_TIMEOUT_S = 1.0
BACKENDS = ("auto", "cachekeeper", "redis")
HOOK_DIR = remote_tier.TIER_HOOK
# The torch versions (major, minor) the backend is used with: torch/_inductor/remote_cache.py
# read in 2.11, 2.12, 2.13, 2.14 and main after 2.14 (backend_override_cls, RedisRemoteCache
# and its five caches, unchanged; 2.13 added LocalCache under RemoteCache). 2.15's wheel
# could not be fetched to read; the issue reports it unchanged, and the hook checks the
# module itself at import (``_cachekeeper_tier.check``) and stays out when it differs.
CHECKED_TORCH = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
_VERSION = re.compile(r"^(\d+)\.(\d+)")
_WRITES = {
    None: "reads and writes",
    "read_only_token": "reads only: the token has the read scope",
    "signatures_required": "reads only: the server trusts signing keys, its tier is read-only",
}


@dataclass(frozen=True)
class TierChoice:
    """What the hook decided: the variables to export, whether the job uses the tier and
    by which path (``backend``: "cachekeeper" or "redis"), whether it writes, and prejob's
    line (``note``); ``reason`` says why the job is off a tier the server offers."""

    exports: dict[str, str]
    used: bool
    writable: bool = False
    reason: str | None = None
    backend: str | None = None
    note: str | None = None


def _command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def probe(
    host: str,
    port: int,
    *,
    token: str | None,
    timeout_s: float = PROBE_TIMEOUT_S,
    tls: bool = False,
) -> str | None:
    """None when the tier at ``host:port`` accepts ``token`` and answers PING within
    ``timeout_s`` (over TLS with ``tls``); else why not, in a few words."""
    payload = (_command(b"AUTH", token.encode()) if token else b"") + _command(b"PING")
    want = (b"+OK\r\n" if token else b"") + b"+PONG\r\n"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            sock = tls_context().wrap_socket(raw, server_hostname=host) if tls else raw
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


def checked_torch(version: str | None) -> bool:
    """Whether torch ``version`` ("2.13.0+cpu") is one the backend was checked against."""
    found = _VERSION.match(version or "")
    return found is not None and (int(found[1]), int(found[2])) in CHECKED_TORCH


def write_token_file(token: str, *, environ: Mapping[str, str]) -> Path:
    """A 0600 file (in a 0700 folder under the cachekeeper home) holding ``token``, named by
    the token's id: what a job's tier backend reads, so the token is in no export."""
    folder = config.tier_token_dir(environ)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    path = folder / f"token-{hashlib.sha256(token.encode()).hexdigest()[:12]}"
    atomic_write_bytes(path, token.encode(), mode=0o600)
    return path


def _off(offer: RemoteCacheOffer, reason: str) -> TierChoice:
    return TierChoice(
        exports=remote_tier.job_environ(offer.switches, url=None), used=False, reason=reason
    )


def tier_exports(
    offer: RemoteCacheOffer | None,
    *,
    server: str,
    token: str | None,
    wish: str,
    client_name: str,
    timeout_s: float = PROBE_TIMEOUT_S,
    backend: str = "auto",
    torch_version: str | None = None,
    trusted: bool = False,
    allow_plaintext: bool = False,
    environment: str = "",
    stats_dir: Path | None = None,
    call_timeout_s: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> TierChoice:
    """The job's variables for ``offer`` (None: the server serves no tier: none)."""
    env = os.environ if environ is None else environ
    if offer is None:
        return TierChoice(exports={}, used=False)
    if wish == "off":
        return _off(offer, "--no-remote-cache")
    if not offer.use:
        return _off(offer, "off by the server's default (prejob --remote-cache turns it on)")
    if trusted:
        return _off(
            offer,
            "this node trusts signing keys (--trust / CACHEKEEPER_TRUSTED_KEYS) and tier values"
            " are not signed: reads and writes are off",
        )
    path, why = _path(offer, backend=backend, torch_version=torch_version)
    writes = (
        _WRITES[None]
        if offer.writable
        else _WRITES.get(offer.write_refusal) or "reads only: the server drops this token's puts"
    )
    if path == "cachekeeper":
        refused = plaintext_reason(server, token=token, allow=allow_plaintext)
        if refused is not None:
            return _off(offer, refused)
        exports = _backend_exports(
            offer,
            server=server,
            token=token,
            environment=environment,
            stats_dir=stats_dir,
            call_timeout_s=call_timeout_s,
            environ=env,
        )
        note = f"per-key tier on for this job through cachekeeper's backend: {writes}"
        return TierChoice(
            exports=exports, used=True, writable=offer.writable, backend=path, note=note
        )
    return _redis_path(
        offer,
        server=server,
        token=token,
        client_name=client_name,
        timeout_s=timeout_s,
        allow_plaintext=allow_plaintext,
        writes=writes,
        why=why,
        stats_dir=stats_dir,
        environ=env,
    )


def _watch_exports(stats_dir: Path | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The hook in watch mode for the stock path: it installs nothing, and each process
    records torch's remote-cache counts and whether it could import redis-py, so postjob
    can say why a job asked the tier nothing."""
    if stats_dir is None:
        return {}
    old = environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": str(HOOK_DIR) + (f"{os.pathsep}{old}" if old else ""),
        config.TIER_MODE: "redis",
        config.TIER_STATS_DIR: str(stats_dir),
    }


def _path(
    offer: RemoteCacheOffer, *, backend: str, torch_version: str | None
) -> tuple[str, str | None]:
    """("cachekeeper" or "redis", why the stock path when ``auto`` did not pick ours)."""
    if backend in ("cachekeeper", "redis"):
        return backend, None
    if not offer.http:
        return "redis", "the server does not serve the tier over HTTP (an older server)"
    if not checked_torch(torch_version):
        return "redis", (
            f"torch {torch_version or '(not found)'} is not a version cachekeeper's backend was"
            " checked against (2.11-2.15)"
        )
    return "cachekeeper", None


def _backend_exports(
    offer: RemoteCacheOffer,
    *,
    server: str,
    token: str | None,
    environment: str,
    stats_dir: Path | None,
    call_timeout_s: float | None,
    environ: Mapping[str, str],
) -> dict[str, str]:
    exports = {**offer.switches, remote_tier.URL: remote_tier.OFF_URL}
    old = environ.get("PYTHONPATH")
    exports["PYTHONPATH"] = str(HOOK_DIR) + (f"{os.pathsep}{old}" if old else "")
    exports[config.TIER_MODE] = "cachekeeper"
    exports[config.TIER_URL] = server_root(server)
    if token:
        exports[config.TIER_TOKEN_FILE] = str(write_token_file(token, environ=environ))
    exports[config.TIER_ENVIRONMENT] = environment
    exports[config.TIER_WRITES] = "1" if offer.writable else "0"
    if call_timeout_s is not None:
        exports[config.TIER_TIMEOUT_S] = f"{call_timeout_s:g}"
    if stats_dir is not None:
        exports[config.TIER_STATS_DIR] = str(stats_dir)
    return exports


def _redis_path(
    offer: RemoteCacheOffer,
    *,
    server: str,
    token: str | None,
    client_name: str,
    timeout_s: float,
    allow_plaintext: bool,
    writes: str,
    why: str | None,
    stats_dir: Path | None,
    environ: Mapping[str, str],
) -> TierChoice:
    host = urlsplit(server).hostname or "localhost"
    url = remote_tier.tier_url(
        server,
        port=offer.port,
        token=token,
        name=client_name,
        tls=offer.tls,
        ca_bundle=config.ca_bundle(environ),
    )
    refused = plaintext_reason(url, token=token, allow=allow_plaintext)
    if refused is not None:
        return _off(offer, refused)
    if importlib.util.find_spec("redis") is None:
        return _off(offer, "redis-py is not installed here (pip install redis)")
    problem = probe(host, offer.port, token=token, timeout_s=timeout_s, tls=offer.tls)
    if problem is not None:
        return _off(offer, problem)
    note = (
        f"per-key tier on for this job through torch's redis-py path ({why or 'asked for'}):"
        f" {writes}; a tier that stops answering mid-compile can fail that compile"
        " (docs/server.md)"
    )
    return TierChoice(
        exports={
            **remote_tier.job_environ(offer.switches, url=url),
            **_watch_exports(stats_dir, environ),
        },
        used=True,
        writable=offer.writable,
        backend="redis",
        note=note,
    )
