"""Every ``CACHEKEEPER_*`` environment variable and every default derived from one.

Stdlib only, and nothing is read at import: each function takes the ``environ`` mapping to
read (callers pass ``os.environ``; tests pass a dict). An empty variable counts as unset,
except ``CACHEKEEPER_TRUSTED_KEYS``: set to nothing (or only blanks) it would silently turn
signature checks off, so it counts as a trust list naming a key that cannot be read, and
every snapshot is refused, as for a missing key file.

=================================== ==================================================
variable                            meaning (default)
=================================== ==================================================
``CACHEKEEPER_HOME``                the local store, the agent's work dir, the server's
                                    data dir and the hook's cache dirs live under it
                                    (``~/.cache/cachekeeper``)
``CACHEKEEPER_SERVER``              the cache server URL for push, pull, prejob, agent
``CACHEKEEPER_TOKEN``               the bearer token those commands send
``CACHEKEEPER_CA_BUNDLE``           a PEM file of CAs to trust for ``https://`` servers,
                                    besides the default ones (``--ca-bundle``)
``CACHEKEEPER_ALLOW_PLAINTEXT``     ``1`` (or ``true``, ``yes``, ``on``): send the token
                                    over plain ``http://`` to a host that is not loopback
                                    (``--allow-plaintext``; default: refused)
``CACHEKEEPER_TRUSTED_KEYS``        public key files to trust, ``os.pathsep``-separated
``CACHEKEEPER_DEBUG``               any value: a traceback instead of the one-line error
``CACHEKEEPER_FINGERPRINT_OVERRIDES`` a JSON object merged into the fingerprint (tests)
``CACHEKEEPER_TEST_FAKE_CUDA``      ``1``: a prewarm child fakes a GPU (our tests only)
``CACHEKEEPER_RELIABILITY_LOG``     where tests/hardening log outcomes (tests only)
``CACHEKEEPER_EVIDENCE_DIR``        set by prewarm/verify for a ``[[command]]``: where each
                                    of its Python processes records its cache counters
                                    (read by ``_evidence_hook/sitecustomize.py``, stdlib
                                    only, since the command may run another Python)
``CACHEKEEPER_ALLOW_PLAINTEXT``     ``1``: a client may send its token over plain http (or
                                    ``redis://``) to a host that is not loopback
                                    (``--allow-plaintext``)
``CACHEKEEPER_TIER_*``              set by prejob for a job that uses the per-key tier
                                    through cachekeeper's backend (``_MODE``, ``_URL``,
                                    ``_TOKEN_FILE``, ``_ENVIRONMENT``, ``_WRITES``,
                                    ``_TIMEOUT_S``, ``_STATS_DIR``); read by
                                    ``_tier_hook/_cachekeeper_tier.py`` (stdlib only: the
                                    job may run another Python)
``CACHEKEEPER_<FIELD>``             the server's settings (``server/settings.py``, read
                                    by pydantic-settings with ``SERVER_ENV_PREFIX``)
=================================== ==================================================

Layout under the home::

    $CACHEKEEPER_HOME/
      blobs/ snapshots/       # the local store (cachekeeper.store)
      agent/                  # the agent's builds (cachekeeper.builder.agent)
      server/                 # the server's data dir (cachekeeper.server.settings)
      inductor/<fp16>/        # prejob's cache dir when TORCHINDUCTOR_CACHE_DIR is unset
      tier/token-<id>         # the token a job's tier backend reads (0600, folder 0700)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "HOME",
    "SERVER",
    "TOKEN",
    "CA_BUNDLE",
    "ALLOW_PLAINTEXT",
    "TRUSTED_KEYS",
    "DEBUG",
    "FINGERPRINT_OVERRIDES",
    "TEST_FAKE_CUDA",
    "EVIDENCE_DIR",
    "SERVER_ENV_PREFIX",
    "TIER_MODE",
    "TIER_URL",
    "TIER_TOKEN_FILE",
    "TIER_ENVIRONMENT",
    "TIER_WRITES",
    "TIER_TIMEOUT_S",
    "TIER_STATS_DIR",
    "allow_plaintext",
    "tier_token_dir",
    "home",
    "agent_work_dir",
    "server_data_dir",
    "node_cache_dir",
    "trusted_key_paths",
    "ca_bundle",
    "debug",
    "fingerprint_overrides",
    "package_version",
]

HOME = "CACHEKEEPER_HOME"
SERVER = "CACHEKEEPER_SERVER"
TOKEN = "CACHEKEEPER_TOKEN"
CA_BUNDLE = "CACHEKEEPER_CA_BUNDLE"
ALLOW_PLAINTEXT = "CACHEKEEPER_ALLOW_PLAINTEXT"
TRUSTED_KEYS = "CACHEKEEPER_TRUSTED_KEYS"
DEBUG = "CACHEKEEPER_DEBUG"
FINGERPRINT_OVERRIDES = "CACHEKEEPER_FINGERPRINT_OVERRIDES"
TEST_FAKE_CUDA = "CACHEKEEPER_TEST_FAKE_CUDA"
EVIDENCE_DIR = "CACHEKEEPER_EVIDENCE_DIR"
SERVER_ENV_PREFIX = "CACHEKEEPER_"
TIER_MODE = "CACHEKEEPER_TIER_MODE"
TIER_URL = "CACHEKEEPER_TIER_URL"
TIER_TOKEN_FILE = "CACHEKEEPER_TIER_TOKEN_FILE"
TIER_ENVIRONMENT = "CACHEKEEPER_TIER_ENVIRONMENT"
TIER_WRITES = "CACHEKEEPER_TIER_WRITES"
TIER_TIMEOUT_S = "CACHEKEEPER_TIER_TIMEOUT_S"
TIER_STATS_DIR = "CACHEKEEPER_TIER_STATS_DIR"


def home(environ: Mapping[str, str]) -> Path:
    """``$CACHEKEEPER_HOME``, else ``~/.cache/cachekeeper``."""
    value = environ.get(HOME)
    return Path(value) if value else Path.home() / ".cache" / "cachekeeper"


def agent_work_dir(environ: Mapping[str, str]) -> Path:
    """Where the agent stages its builds: ``<home>/agent``."""
    return home(environ) / "agent"


def server_data_dir(environ: Mapping[str, str]) -> Path:
    """The server's metadata and blobs: ``<home>/server``."""
    return home(environ) / "server"


def node_cache_dir(fingerprint_digest: str, environ: Mapping[str, str]) -> Path:
    """The hook's persistent per-fingerprint cache dir: ``<home>/inductor/<digest[:16]>``."""
    return home(environ) / "inductor" / fingerprint_digest[:16]


def trusted_key_paths(environ: Mapping[str, str]) -> list[str]:
    """The public key files named by ``$CACHEKEEPER_TRUSTED_KEYS``: none when it is unset;
    ``[""]`` (an empty path, which no key is read from) when it is set but names none."""
    if TRUSTED_KEYS not in environ:
        return []
    paths = [p for p in environ[TRUSTED_KEYS].split(os.pathsep) if p.strip()]
    return paths or [""]


def tier_token_dir(environ: Mapping[str, str]) -> Path:
    """Where prejob leaves the token a job's tier backend reads: ``<home>/tier``."""
    return home(environ) / "tier"


def ca_bundle(environ: Mapping[str, str]) -> str | None:
    """``$CACHEKEEPER_CA_BUNDLE``: extra CAs for ``https://`` servers (None when unset)."""
    return environ.get(CA_BUNDLE) or None


def allow_plaintext(environ: Mapping[str, str]) -> bool:
    """``$CACHEKEEPER_ALLOW_PLAINTEXT`` is ``1``/``true``/``yes``/``on``: a client may send
    its token over plain ``http://`` to a host that is not loopback (anything else: no)."""
    return environ.get(ALLOW_PLAINTEXT, "").strip().lower() in ("1", "true", "yes", "on")


def debug(environ: Mapping[str, str]) -> bool:
    """``$CACHEKEEPER_DEBUG`` set: show tracebacks instead of one-line errors."""
    return bool(environ.get(DEBUG))


def fingerprint_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``$CACHEKEEPER_FINGERPRINT_OVERRIDES`` as a dict (empty when unset)."""
    raw = environ.get(FINGERPRINT_OVERRIDES)
    return dict(json.loads(raw)) if raw else {}


def package_version() -> str:
    """The installed cachekeeper's version (``0+unknown`` in a bare checkout)."""
    # importlib.metadata costs tens of ms: only the agent and the server ask, never the hook
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cachekeeper")
    except PackageNotFoundError:  # pragma: no cover - a bare checkout
        return "0+unknown"
