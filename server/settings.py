"""Server settings: flags > environment (``CACHEKEEPER_*``) > TOML config file > defaults.

Built by ``load_settings()`` (or ``Settings(...)`` directly in tests); nothing is read at
import time. Tokens come from the config file (``[tokens]`` table, token = scope) or from
``CACHEKEEPER_TOKENS`` as JSON (``{"tok": "admin"}``) or ``"tok:admin,tok2:read"``. They
are kept out of ``repr`` so a logged settings object never shows them.

An empty variable (``CACHEKEEPER_TOKENS=``) is not a setting: it is ignored, so it can never
replace the config file's tokens and switch auth off. A config key that is not a setting,
a value that does not validate, and a server bound to a non-loopback address with auth off
(unless ``insecure_no_auth``) are ``ConfigInvalid`` errors naming the setting, where it came
from (option, variable or file) and the value (never a token's). Sizes take units:
``10GB`` (10**9), ``512MiB`` (2**20), ``2T``, or plain bytes.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import tempfile
import tomllib
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from cachekeeper import config
from cachekeeper.backends import registry
from cachekeeper.errors import ConfigInvalid
from cachekeeper.snapshot.manifest import MAX_FILES
from cachekeeper.snapshot.signing import load_trusted_keys
from cachekeeper.units import parse_duration

__all__ = [
    "Scope",
    "Settings",
    "check_data_dir",
    "default_data_dir",
    "is_loopback",
    "load_settings",
    "parse_size",
    "parse_tokens",
    "stray_variables",
]

Scope = Literal["read", "write", "admin"]
SCOPES: tuple[str, ...] = ("read", "write", "admin")
ENV_PREFIX = config.SERVER_ENV_PREFIX

_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-z]*)$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{u: 1000**n for n, u in enumerate(("k", "m", "g", "t", "p"), start=1)},
    **{f"{u}b": 1000**n for n, u in enumerate(("k", "m", "g", "t", "p"), start=1)},
    **{f"{u}i": 1024**n for n, u in enumerate(("k", "m", "g", "t", "p"), start=1)},
    **{f"{u}ib": 1024**n for n, u in enumerate(("k", "m", "g", "t", "p"), start=1)},
}
_SIZE_FIELDS = (
    "max_blob_bytes",
    "max_manifest_bytes",
    "max_workload_bytes",
    "max_json_bytes",
    "max_store_bytes",
    "remote_cache_max_value_bytes",
    "remote_cache_max_bytes",
    "remote_cache_memory_bytes",
    "remote_cache_pending_bytes",
    "remote_cache_output_bytes",
    "remote_cache_max_key_bytes",
    "max_catalog_bytes",
    "reports_max_bytes",
    "agent_events_max_bytes",
)
_DURATION_FIELDS = (
    "reports_window_s",
    "reports_retention_s",
    "agent_events_retention_s",
    "agents_retention_s",
    "events_retention_s",
)
_COUNT_FIELDS = (
    "reports_per_token",
    "report_jobs_per_token",
    "reports_max_rows",
    "agent_events_max_rows",
    "max_agents",
    "max_workloads",
    "max_snapshots",
    "max_harvested_deltas",
    "events_max_rows",
)


def default_data_dir(environ: dict[str, str] | None = None) -> Path:
    """``$CACHEKEEPER_HOME/server``, else ``~/.cache/cachekeeper/server``."""
    return config.server_data_dir(os.environ if environ is None else environ)


def parse_size(value: Any) -> int:
    """Bytes from an int or a text with a unit: ``10GB`` = 10**9 bytes, ``512MiB`` = 2**20."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative; a size is 0 or more bytes")
        return value
    text = str(value).strip().lower().replace("_", "")
    found = _SIZE_RE.match(text)
    if found is None or found.group(2) not in _SIZE_UNITS:
        raise ValueError(
            f"{value!r} is not a size: give bytes, or a number with a unit"
            " (10GB = 10**9 bytes, 512MiB = 2**20 bytes; B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    try:
        return int(Decimal(found.group(1)) * _SIZE_UNITS[found.group(2)])
    except InvalidOperation as exc:  # pragma: no cover - the pattern only admits numbers
        raise ValueError(f"{value!r} is not a size") from exc


def parse_tokens(raw: Any) -> dict[str, str]:
    """Tokens from a mapping, a JSON object text, or ``"tok:scope,tok:scope"``."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        text = raw.strip()
        if text.startswith("{"):
            raw = json.loads(text)
        else:
            pairs: dict[str, str] = {}
            for item in filter(None, (p.strip() for p in text.split(","))):
                token, sep, scope = item.rpartition(":")
                if not sep or not token:
                    raise ValueError("items must look like 'token:scope'")
                pairs[token] = scope
            raw = pairs
    if not isinstance(raw, dict):
        raise ValueError("tokens must be a mapping of token -> scope")
    out: dict[str, str] = {}
    for token, scope in raw.items():
        if scope not in SCOPES:
            # never echo the token itself
            raise ValueError(f"token scope {scope!r} is not one of {', '.join(SCOPES)}")
        out[str(token)] = str(scope)
    return out


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); False for anything else."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


class Settings(BaseSettings):
    """Everything the server can be configured with."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", env_ignore_empty=True)

    data_dir: Path = Field(default_factory=default_data_dir)
    # Where blob bytes live, a URL whose scheme cachekeeper/backends/registry.py knows: None =
    # ``<data_dir>/blobs`` (the default); ``s3://BUCKET/PREFIX`` = S3-compatible object storage
    # (endpoint, region, credentials from the AWS chain), which nodes then upload to and
    # download from directly through presigned URLs.
    blob_store: str | None = None
    # How long a presigned URL (a node's archive GET, a push's blob PUT) stays valid.
    presign_expires_s: int = 900
    host: str = "127.0.0.1"
    port: int = 8750
    tokens: Annotated[dict[str, Scope], NoDecode] = Field(default_factory=dict, repr=False)
    anonymous_read: bool = False
    # Serving a non-loopback address with no tokens is refused unless this is set.
    insecure_no_auth: bool = False
    # Offer harvested deltas (``cachekeeper postjob --push``) after the snapshot they were
    # compiled on top of, in resolve's ``deltas``. Off: they are stored but never served.
    serve_harvested: bool = False
    max_blob_bytes: int = 2 << 30
    max_manifest_bytes: int = 64 << 20
    max_files: int = MAX_FILES
    max_workload_bytes: int = 256 << 10  # a real workload file is a few KB
    # Every other request body (resolve, blobs/missing, archive, agents, gc): 200 000
    # digests as JSON fit.
    max_json_bytes: int = 16 << 20
    # A request body that sends no byte for this long is cut off (408).
    body_timeout_s: float = 30.0
    # A request's headers must be complete this long after its first byte (after the
    # connection opened, for the first request), or the connection is closed; and at most
    # max_connections at once (None: the open-file limit less what the server itself
    # needs, at most 4096). See server/connections.py.
    header_timeout_s: float = 10.0
    max_connections: int | None = None
    # Threads that hash and write uploads; uploads beyond it wait without holding a thread,
    # so uploads (stalled or not) never take the threads health, resolve and archive use.
    upload_workers: int = 16
    # Hard cap on stored (compressed) bytes: an upload whose received bytes would pass it
    # gets 507. Uploads never evict; GC evicts LRU snapshots down to it. None = unlimited.
    max_store_bytes: int | None = None
    # Unreferenced blobs younger than this survive GC (an upload waiting for its publish).
    gc_grace_s: float = 3600.0
    # zstd level for the small files an archive stream recompresses (big blobs are spliced).
    archive_level: int = 1
    log_level: str = "info"
    # Public keys (``PREFIX.pub`` files) whose signatures a publish may carry, and whether
    # a publish must carry one: with require_signatures, an unsigned, untrusted or
    # tampered manifest is refused (422 signature_invalid). The environment names them
    # as CACHEKEEPER_TRUSTED_KEYS, paths separated by os.pathsep, like the client.
    trusted_keys: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    require_signatures: bool = False
    # -- the per-key tier (server/resources/tier.py, server/resp/listener.py; docs/server.md) ----------------
    # The port of ``host`` on which the server speaks the Redis protocol subset torch's
    # remote caches use (redis-py). None: no tier; 0: any free port (tests).
    resp_port: int | None = None
    # Whether a node's job uses the tier when its prejob says neither --remote-cache nor
    # --no-remote-cache. The switches stay on either way (one is in torch's keys).
    remote_cache_default: bool = True
    # A value larger than this is not stored (its SET is answered OK and dropped).
    remote_cache_max_value_bytes: int = 128 << 20
    # The tier's stored bytes: least recently used keys are evicted down to it. None: no cap.
    remote_cache_max_bytes: int | None = 20 << 30
    # The most recently used values kept in memory, checked, for GETs that cost a copy.
    remote_cache_memory_bytes: int = 256 << 20
    # A GET the store cannot answer within this is answered nil (a miss), never late.
    remote_cache_get_timeout_s: float = 1.0
    # Values (and their keys) that wait to be stored or are being received (SETs are
    # answered at once); past this, SETs are dropped.
    remote_cache_pending_bytes: int = 512 << 20
    # A key longer than this is not stored (its SET answers OK) and reads as a miss; key
    # and writer bytes count in remote_cache_max_bytes. torch's keys are ~100 bytes.
    remote_cache_max_key_bytes: int = 1 << 10
    # GET values read from the store that clients have not taken yet; past this, GETs are
    # answered nil (a miss) rather than pinning more memory for unread replies.
    remote_cache_output_bytes: int = 256 << 20
    # The listener's connections (server/resp/listener.py, server/resp/bounds.py): at most this many
    # at once (None: the tier's share of the descriptor budget, server/connections.py); a
    # connection must authenticate within auth_timeout_s of opening, an authenticated one
    # that sends nothing for idle_timeout_s is closed (redis-py reconnects), and a command
    # must arrive whole, and a reply be taken whole, within frame_timeout_s.
    remote_cache_max_connections: int | None = None
    remote_cache_auth_timeout_s: float = 10.0
    remote_cache_idle_timeout_s: float = 300.0
    remote_cache_frame_timeout_s: float = 30.0
    # With trusted_keys configured, the tier is read-only (its values are unsigned code
    # torch runs, docs/security.md) unless this is set.
    remote_cache_unsigned_writes: bool = False
    # Serve a tier value to a reader whose environment (fingerprint) is not its writer's.
    # Off: torch's keys leave out what the fingerprint adds (the driver, the CUDA wheels'
    # versions), so a value from another environment may not run here.
    remote_cache_cross_environment: bool = False
    # Serve https: the certificate chain and its private key (PEM files, given to uvicorn).
    # Or terminate TLS in a reverse proxy in front (docs/server.md); either way, never send
    # bearer tokens over plain http off the host.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # /metrics without a token (a Prometheus that scrapes without one). Off by default:
    # /metrics needs the read scope like every read route, since its labels name workloads.
    metrics_public: bool = False
    # -- the catalog and what clients write into it (server/budgets.py; docs/server.md) ---
    # At start-up: "quick" (PRAGMA quick_check: every page read, ~1-2 s per GB), "full"
    # (integrity_check, indexes too: ~5x slower) or "off"; a corrupt catalog is refused.
    catalog_check: Literal["quick", "full", "off"] = "quick"
    # meta.sqlite's size: past it, every write of rows a client sends (publish, workload,
    # agent, agent event, job report) is refused (507) until GC or retention frees pages.
    max_catalog_bytes: int = 4 << 30
    # Job reports: the window per-token budgets count in, what one token (every caller
    # without one, with auth off) may file in it, and what the table keeps.
    reports_window_s: float = 3600.0
    reports_per_token: int = 1000  # reports per window (every rank's prejob is one)
    report_jobs_per_token: int = 100  # new jobs (a node's job, counted once) per window
    reports_max_rows: int = 500_000  # the oldest are dropped past either bound
    reports_max_bytes: int = 256 << 20
    reports_retention_s: float = 90 * 86400.0
    # Agents' build events: the newest event of each (workload, fingerprint) is kept (the
    # status is decided from it); older ones past a bound or the retention are dropped.
    agent_events_max_rows: int = 100_000
    agent_events_max_bytes: int = 256 << 20
    agent_events_retention_s: float = 90 * 86400.0
    # Agents (one per name and environment): unseen this long, an agent is removed; past
    # max_agents a new one is refused (507).
    max_agents: int = 1000
    agents_retention_s: float = 90 * 86400.0
    # Workloads (no retention: an admin removes them), snapshots (GC evicts them) and the
    # harvested deltas of one snapshot for one environment (resolve offers 32 at most).
    max_workloads: int = 1000
    max_snapshots: int = 100_000
    max_harvested_deltas: int = 32
    # The audit log (snapshot published, evicted, quarantined): the oldest past the bound
    # or the retention are dropped.
    events_max_rows: int = 100_000
    events_retention_s: float = 365 * 86400.0

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens(cls, value: Any) -> dict[str, str]:
        return parse_tokens(value)

    @field_validator(*_SIZE_FIELDS, mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)

    @field_validator(*_DURATION_FIELDS, mode="before")
    @classmethod
    def _durations(cls, value: Any) -> Any:
        return parse_duration(value)  # 90d, 1h, 3600: seconds, > 0

    @field_validator(*_COUNT_FIELDS)
    @classmethod
    def _at_least_one(cls, value: Any) -> Any:
        if value < 1:
            raise ValueError(f"{value} is not a positive count")
        return value

    @field_validator("blob_store")
    @classmethod
    def _blob_store(cls, value: Any) -> Any:
        if value is not None and not registry.names_a_backend(str(value)):
            raise ValueError(
                f"{value!r} is not {registry.url_forms()} (leave it unset for <data>/blobs)"
            )
        return value

    @field_validator(
        "body_timeout_s",
        "upload_workers",
        "presign_expires_s",
        "header_timeout_s",
        "remote_cache_get_timeout_s",
        "remote_cache_max_value_bytes",
        "remote_cache_pending_bytes",
        "remote_cache_output_bytes",
        "remote_cache_max_key_bytes",
        "remote_cache_auth_timeout_s",
        "remote_cache_idle_timeout_s",
        "remote_cache_frame_timeout_s",
    )
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if value <= 0:
            raise ValueError(f"{value} is not a positive number")
        return value

    @field_validator("max_connections", "remote_cache_max_connections")
    @classmethod
    def _at_least_16(cls, value: Any) -> Any:
        if value is not None and value < 16:
            raise ValueError(f"{value} is fewer than 16 connections")
        return value

    @field_validator("remote_cache_max_key_bytes")
    @classmethod
    def _key_bound(cls, value: Any) -> Any:
        if value > 16 << 10:
            raise ValueError(f"{value} is over 16 KiB, the most a command's key may hold")
        return value

    @field_validator("trusted_keys", mode="before")
    @classmethod
    def _trusted_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            paths = [p for p in value.split(os.pathsep) if p.strip()]
            if not paths:  # blank: never a silent "no keys" (an empty variable is ignored)
                raise ValueError("names no key file; unset it, or name the .pub files")
            return paths
        return value

    @model_validator(mode="after")
    def _signatures_need_keys(self) -> Settings:
        if self.require_signatures and not self.trusted_keys:
            raise ValueError("require_signatures is set but no trusted_keys are configured")
        if self.trusted_keys:
            load_trusted_keys(self.trusted_keys)  # an unreadable key fails at start-up
        return self

    @field_validator("resp_port")
    @classmethod
    def _port(cls, value: Any) -> Any:
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"{value} is not a port (0-65535)")
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (
                ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            )
            raise ValueError(f"{given} is set but {missing} is not: give both (PEM files)")
        if self.tls_cert is not None and self.tls_key is not None:
            import ssl  # only when serving https

            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    self.tls_cert, self.tls_key
                )
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"cannot load the TLS certificate {self.tls_cert} with the key"
                    f" {self.tls_key}: {exc}"
                ) from exc
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens)

    @property
    def remote_cache_writable(self) -> bool:
        """Whether write-scope tokens may write to the per-key tier (read-only while
        snapshots must be signed, unless the operator opted in)."""
        return not self.trusted_keys or self.remote_cache_unsigned_writes

    @property
    def scheme(self) -> str:
        """``https`` when the server itself serves TLS, else ``http``."""
        return "https" if self.tls_cert is not None else "http"


def _env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def _option_name(field: str) -> str:
    return {"data_dir": "--data", "tokens": "--token"}.get(field, f"--{field.replace('_', '-')}")


def _describe(exc: ValidationError, where: dict[str, str]) -> str:
    """One line per problem: ``WHERE = VALUE: why`` (a token's value is never shown)."""
    parts = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err.get("loc") else ""
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        source = where.get(field, field or "settings")
        if field and field != "tokens" and "input" in err:
            source = f"{source} = {err['input']!r}"
        parts.append(f"{source}: {message}")
    return "; ".join(parts) or str(exc)


def _read_config(config_file: Path) -> dict[str, Any]:
    try:
        values = tomllib.loads(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigInvalid(f"cannot read config file {config_file}: {exc}") from exc
    known = list(Settings.model_fields)
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; settings: {', '.join(known)}"
            raise ConfigInvalid(f"config file {config_file}: unknown setting {key!r}{hint}")
    return values


def load_settings(*, config_file: Path | None = None, **overrides: Any) -> Settings:
    """Settings with precedence ``overrides`` > environment > ``config_file`` > defaults.

    ``overrides`` whose value is None are ignored (an option not given on the command line).
    Raises ConfigInvalid naming the setting, its source and its value.
    """
    file_values = _read_config(config_file) if config_file is not None else {}
    env_where = {name: _env_name(name) for name in Settings.model_fields}
    try:
        from_env = Settings()
    except ValidationError as exc:
        raise ConfigInvalid(_describe(exc, env_where)) from exc
    env_values = {name: getattr(from_env, name) for name in from_env.model_fields_set}
    if "tokens" in env_values and not env_values["tokens"]:
        if not os.environ.get(_env_name("tokens"), "").strip():
            del env_values["tokens"]  # blank, like empty: not a setting
        else:
            raise ConfigInvalid(
                f"{_env_name('tokens')} is set but holds no token; unset it to use the"
                " config file's tokens (an empty token list never switches auth off)"
            )
    given = {k: v for k, v in overrides.items() if v is not None}
    where = {name: f"{name} in {config_file}" for name in file_values}
    where.update({name: env_where[name] for name in env_values})
    where.update({name: _option_name(name) for name in given})
    try:
        settings = Settings(**{**file_values, **env_values, **given})
    except ValidationError as exc:
        raise ConfigInvalid(_describe(exc, where)) from exc
    if not settings.auth_enabled and not is_loopback(settings.host):
        if not settings.insecure_no_auth:
            raise ConfigInvalid(
                f"refusing to serve {settings.host} with auth off: configure tokens"
                f" ({_env_name('tokens')}, [tokens] in --config, or --token TOKEN:SCOPE), or"
                " pass --insecure-no-auth to open every route to anyone who can reach it"
            )
    return settings


# CACHEKEEPER_* variables that are not server settings but belong to the CLI, the client or
# the tests (cachekeeper/config.py): a server ignores them without a word.
_NOT_SERVER_SETTINGS = (
    config.HOME,
    config.SERVER,
    config.TOKEN,
    config.CA_BUNDLE,
    config.DEBUG,
    config.FINGERPRINT_OVERRIDES,
    config.TEST_FAKE_CUDA,
    "CACHEKEEPER_RELIABILITY_LOG",
)


def stray_variables(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """One warning per ``CACHEKEEPER_*`` variable that is no setting (a typo, say)."""
    known = [_env_name(name) for name in Settings.model_fields]
    warnings = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name in _NOT_SERVER_SETTINGS:
            continue
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.append(f"{name} is not a server setting and is ignored{hint}")
    return warnings


def check_data_dir(path: Path) -> None:
    """Create ``path`` if needed and prove the server can write there, else ConfigInvalid.

    The error names the path and the cause, and who owns it when that is not us (a
    root-owned bind mount under a non-root server is the usual case).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
        for inner in (path / "meta.sqlite", path / "blobs"):
            if inner.exists() and not os.access(inner, os.W_OK):
                raise PermissionError(13, "Permission denied", str(inner))
    except OSError as exc:
        inner_name = str(exc.filename or "")
        shown = inner_name and inner_name != str(path) and ".write-probe-" not in inner_name
        named = f" ({inner_name})" if shown else ""
        cause = exc.strerror or str(exc)
        raise ConfigInvalid(
            f"data dir {path} is not usable: {cause}{named}{_owner_hint(path)}"
        ) from exc


def _owner_hint(path: Path) -> str:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        owner = existing.stat().st_uid
    except OSError:
        return ""
    if owner == os.geteuid():
        return ""
    return (
        f"; {existing} is owned by uid {owner} and this server runs as uid {os.geteuid()}"
        " (chown it, or pick another --data)"
    )
