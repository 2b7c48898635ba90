"""Server settings: flags > environment (``CACHEKEEPER_*``) > TOML config file > defaults.

Built by ``load_settings()`` (or ``Settings(...)`` directly in tests); nothing is read at
import time. Tokens come from the config file (``[tokens]`` table, token = scope) or from
``CACHEKEEPER_TOKENS`` as JSON (``{"tok": "admin"}``) or ``"tok:admin,tok2:read"``. They
are kept out of ``repr`` so a logged settings object never shows them.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from cachekeeper.manifest import MAX_FILES

__all__ = ["Scope", "Settings", "default_data_dir", "load_settings", "parse_tokens"]

Scope = Literal["read", "write", "admin"]
SCOPES: tuple[str, ...] = ("read", "write", "admin")


def default_data_dir(environ: dict[str, str] | None = None) -> Path:
    """``$CACHEKEEPER_HOME/server``, else ``~/.cache/cachekeeper/server``."""
    env = os.environ if environ is None else environ
    home = env.get("CACHEKEEPER_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "cachekeeper"
    return base / "server"


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
                    raise ValueError("CACHEKEEPER_TOKENS items must look like 'token:scope'")
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


class Settings(BaseSettings):
    """Everything the server can be configured with."""

    model_config = SettingsConfigDict(env_prefix="CACHEKEEPER_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    host: str = "127.0.0.1"
    port: int = 8750
    tokens: Annotated[dict[str, Scope], NoDecode] = Field(default_factory=dict, repr=False)
    anonymous_read: bool = False
    max_blob_bytes: int = 2 << 30
    max_manifest_bytes: int = 64 << 20
    max_files: int = MAX_FILES
    max_workload_bytes: int = 1 << 20
    # Hard cap on stored (compressed) bytes: an upload over it first evicts LRU snapshots,
    # then gets 507. None = unlimited.
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

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens(cls, value: Any) -> dict[str, str]:
        return parse_tokens(value)

    @field_validator("trusted_keys", mode="before")
    @classmethod
    def _trusted_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [p for p in value.split(os.pathsep) if p.strip()]
        return value

    @model_validator(mode="after")
    def _signatures_need_keys(self) -> Settings:
        if self.require_signatures and not self.trusted_keys:
            raise ValueError("require_signatures is set but no trusted_keys are configured")
        if self.trusted_keys:
            from cachekeeper.signing import load_trusted_keys

            load_trusted_keys(self.trusted_keys)  # an unreadable key fails at start-up
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens)


def load_settings(*, config_file: Path | None = None, **overrides: Any) -> Settings:
    """Settings with precedence ``overrides`` > environment > ``config_file`` > defaults.

    ``overrides`` whose value is None are ignored (an option not given on the command line).
    """
    file_values: dict[str, Any] = {}
    if config_file is not None:
        try:
            file_values = tomllib.loads(Path(config_file).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read config file {config_file}: {exc}") from exc
    from_env = Settings()
    env_values = {name: getattr(from_env, name) for name in from_env.model_fields_set}
    given = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**{**file_values, **env_values, **given})
