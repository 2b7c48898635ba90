"""Which torch switches a job runs with for the per-key tier, and which of them are in torch's keys.

The one owner of that knowledge (stdlib only: the hook imports it). torch's remote caches
(FX graph, AOTAutograd, autotune, automatic-dynamic PGO) are switched on by environment
variables and reach the server named by ``TORCHINDUCTOR_REDIS_URL`` through redis-py;
cachekeeper's server speaks that protocol on its RESP port (``server/resp/listener.py``).

Two of the switches are part of torch's cache keys (measured on torch 2.11 on an H200 and
2.13 on the CPU, ``KEY_RELEVANT``): the AOTAutograd key holds
``TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE`` (functorch's config is in it), the FX graph key
``TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE`` (Inductor's config is, less the options
torch lists as cache-only). So every process whose cache must serve a job, prewarm and
verify included, runs with the same values of those two, and the fingerprint records them
(``fingerprint.collect`` keeps them in ``env`` and leaves out the rest of this module's
variables: ``NOT_IN_KEYS``, among them the URL that carries a token). Bundled autotune is
never switched on (with remote AOTAutograd it crashes a fresh node on 2.11, and any
compile on the CPU on 2.13), nor set to ``0`` (that is another key than unset).

Who calls what:

- the server: ``site_switches(tier=...)``, the switches every job and builder of the site
  runs with (all four when it serves the tier, else none), sent in resolve's answer and
  in ``GET /v1/remote-cache``; ``with_key_switches`` puts a node's into the fingerprint it
  ranks snapshots for;
- the hook (``client/prejob.py``): ``job_environ(switches, url=...)``, its exports; a job
  that does not use the tier (``--no-remote-cache``, a port that does not answer) still
  runs with the key-relevant switches, pointed at ``OFF_URL`` (refused at once, which
  torch takes as "no remote cache"), so it hits the snapshots built with them;
- the agent: ``set_builder_switches(os.environ, switches)``, so its children and its
  fingerprint run as nodes do;
- prewarm and verify children (``cachekeeper.builder.children.child_environ``) and a workload's
  commands: ``isolated(environ)``, the builder's switches with every URL replaced by
  ``OFF_URL`` (whether a switch is on or not) and cachekeeper's own backend switched off
  (``CACHEKEEPER_TIER_*`` dropped), so verify proves the local dir alone, prewarm compiles
  what it lists, and no tier value reaches what a builder signs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

if TYPE_CHECKING:  # types only: at run time this module stays stdlib (the hook imports it)
    from cachekeeper.environment.shape import Fingerprint

__all__ = [
    "AOTAUTOGRAD",
    "AUTOTUNE",
    "BUNDLED_AUTOTUNE",
    "CONNECTION_VARS",
    "FX_GRAPH",
    "KEY_RELEVANT",
    "NOT_IN_KEYS",
    "OFF_URL",
    "PGO",
    "SOCKET_TIMEOUT_S",
    "TIER_HOOK",
    "TIER_VAR_PREFIX",
    "CONNECT_TIMEOUT_S",
    "URL",
    "client_name",
    "environment_of",
    "environment_of_client_name",
    "isolated",
    "job_environ",
    "key_switches",
    "set_builder_switches",
    "site_switches",
    "tier_url",
    "uses_remote",
    "with_key_switches",
]

FX_GRAPH = "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE"
AOTAUTOGRAD = "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE"
AUTOTUNE = "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE"
PGO = "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_REMOTE_PGO"
BUNDLED_AUTOTUNE = "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE"
URL = "TORCHINDUCTOR_REDIS_URL"
# Where torch's redis backend connects (URL first, else HOST/PORT) and the TTL torch main
# adds: no cache key holds them, and the URL holds the node's token.
CONNECTION_VARS = (
    URL,
    "TORCHINDUCTOR_REDIS_HOST",
    "TORCHINDUCTOR_REDIS_PORT",
    "TORCHINDUCTOR_REDIS_EXPIRE",
)

_ON = {FX_GRAPH: "1", AOTAUTOGRAD: "1", AUTOTUNE: "1", PGO: "1"}
KEY_RELEVANT = frozenset({AOTAUTOGRAD, BUNDLED_AUTOTUNE})
# The tier's variables that are in no key: left out of the fingerprint.
NOT_IN_KEYS = frozenset({FX_GRAPH, AUTOTUNE, PGO, *CONNECTION_VARS})
_SWITCHES = frozenset({*_ON, BUNDLED_AUTOTUNE})
_OURS_IN_KEYS = KEY_RELEVANT & _ON.keys()  # the key-relevant switches we set (bundled: never)

# A URL that redis-py fails to connect to at once (a unix socket under a path that cannot
# exist): torch marks that remote cache unavailable for the process, silently, on first use.
OFF_URL = "unix:///nonexistent/cachekeeper-remote-cache-off"

# redis-py waits forever without these. A socket timeout surfaces as redis' TimeoutError,
# which torch does not catch on an AOTAutograd put (see docs/server.md, "per-key tier"):
# the server answers every GET and SET within its own bound, well under them.
SOCKET_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0

# The variables of cachekeeper's own backend (cachekeeper.config's TIER_*), which the
# children of prewarm and verify never inherit.
TIER_VAR_PREFIX = "CACHEKEEPER_TIER_"
# The folder prejob puts first on a job's PYTHONPATH for cachekeeper's own backend.
TIER_HOOK = Path(__file__).resolve().parent / "_tier_hook"

_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
_HEX12 = re.compile(r"^[0-9a-f]{12}$")


def site_switches(*, tier: bool) -> dict[str, str]:
    """The torch switches every job and builder of a site runs with: the four remote
    caches when the server serves the tier (``tier``), none otherwise."""
    return dict(_ON) if tier else {}


def key_switches(switches: Mapping[str, str]) -> dict[str, str]:
    """The part of ``switches`` that is in torch's cache keys."""
    return {k: v for k, v in switches.items() if k in KEY_RELEVANT}


def uses_remote(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` switches any of torch's remote caches on."""
    return any(environ.get(name) == "1" for name in _SWITCHES)


def job_environ(switches: Mapping[str, str], *, url: str | None) -> dict[str, str]:
    """What a job exports: every switch and ``url`` when it uses the tier; else only the
    key-relevant switches, with ``OFF_URL`` when there are any (so the job's keys are those
    of snapshots built with them, and torch connects nowhere)."""
    if url is not None:
        return {**switches, URL: url} if switches else {}
    keyed = key_switches(switches)
    return {**keyed, URL: OFF_URL} if uses_remote(keyed) else keyed


def isolated(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for a prewarm or verify child: its switches as they are, but with no way
    to the tier (``OFF_URL`` replaces any URL, host or port), so that verify proves the
    local dir alone and prewarm compiles everything it lists. Also with no switch on: a
    builder's code that turns a remote cache on by itself must not load tier values (any
    write token's bytes) in a process whose output the builder signs (issue 32); nor
    cachekeeper's own backend (``CACHEKEEPER_TIER_*`` dropped)."""
    env = {k: v for k, v in environ.items() if k not in CONNECTION_VARS and not _ours(k)}
    env[URL] = OFF_URL
    return env


def _ours(name: str) -> bool:
    """A variable of cachekeeper's own tier backend (``CACHEKEEPER_TIER_*``): without
    ``CACHEKEEPER_TIER_MODE`` its hook installs nothing."""
    return name.startswith(TIER_VAR_PREFIX)


def set_builder_switches(environ: MutableMapping[str, str], switches: Mapping[str, str]) -> None:
    """Make ``environ`` (the agent's own) carry exactly ``switches``: its children compile
    and its fingerprint records what nodes run with. The tier's other variables go."""
    for name in (*_SWITCHES, *CONNECTION_VARS, *[k for k in environ if _ours(k)]):
        environ.pop(name, None)
    environ.update(job_environ(switches, url=OFF_URL) if switches else {})


def with_key_switches(fingerprint: Fingerprint, switches: Mapping[str, str]) -> Fingerprint:
    """``fingerprint`` as a job that exports ``switches`` records it: its ``env`` with the
    tier's key-relevant variables replaced by those of ``switches`` (the server ranks a
    node's snapshots for the environment its job will run in, not the hook's)."""
    env = {k: v for k, v in (fingerprint.get("env") or {}).items() if k not in _OURS_IN_KEYS}
    env.update(key_switches(switches))
    return {**fingerprint, "env": dict(sorted(env.items()))}


def client_name(node: str, fingerprint_digest: str) -> str:
    """The redis client name a job announces (``CLIENT SETNAME``): node and fingerprint,
    which the server records as the writer of each value."""
    return _NAME_UNSAFE.sub("_", f"ck:{node}:{fingerprint_digest[:12]}")[:120]


def environment_of(fingerprint_digest: str) -> str:
    """The environment a tier value is written from and served to: the first 12 hex digits
    of the fingerprint digest of the node that runs the job ("" when it has none)."""
    return fingerprint_digest[:12] if _HEX12.match(fingerprint_digest[:12]) else ""


def environment_of_client_name(name: str) -> str:
    """The environment in a redis client name ``client_name`` made (``ck:<node>:<env>``),
    or "" for any other name."""
    if not name.startswith("ck:"):
        return ""
    return environment_of(name.rpartition(":")[2])


def tier_url(
    server_url: str,
    *,
    port: int,
    token: str | None,
    name: str | None = None,
    socket_timeout_s: float = SOCKET_TIMEOUT_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    tls: bool = False,
    ca_bundle: str | None = None,
) -> str:
    """The ``TORCHINDUCTOR_REDIS_URL`` of the tier on ``server_url``'s host at ``port``: the
    token as password, socket and connect timeouts, and the client name; ``rediss://``
    with ``tls`` (and ``ca_bundle``, a site's private CA, as ``ssl_ca_certs``)."""
    host = urlsplit(server_url).hostname or "localhost"
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    auth = f":{quote(token, safe='')}@" if token else ""
    query = f"socket_timeout={socket_timeout_s:g}&socket_connect_timeout={connect_timeout_s:g}"
    if name:
        query += f"&client_name={quote(name, safe='')}"
    if tls and ca_bundle:
        query += f"&ssl_ca_certs={quote(ca_bundle, safe='')}"
    scheme = "rediss" if tls else "redis"
    return f"{scheme}://{auth}{host}:{port}/0?{query}"
