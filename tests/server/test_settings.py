"""Server configuration: errors that name the setting and value, sizes with units, auth that
never switches off by accident, and a clear refusal of an exposed open server or a data dir
it cannot write (issues 17.8, 17.12, 18.5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from cachekeeper.cli import cli as cli_main
from cachekeeper.errors import ConfigInvalid
from cachekeeper.server.settings import load_settings, parse_size, stray_variables
from tests.hardening.conftest import ServerProcess, child_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_server_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("CACHEKEEPER_") and name != "CACHEKEEPER_RELIABILITY_LOG":
            monkeypatch.delenv(name)


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "server.toml"
    path.write_text(text)
    return path


def test_empty_tokens_variable_keeps_the_config_files_tokens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = _config(tmp_path, '[tokens]\n"ops-secret" = "admin"\n')
    for empty in ("", "   "):
        monkeypatch.setenv("CACHEKEEPER_TOKENS", empty)
        settings = load_settings(config_file=config)
        assert settings.tokens == {"ops-secret": "admin"} and settings.auth_enabled
    monkeypatch.setenv("CACHEKEEPER_MAX_STORE_BYTES", "")
    assert load_settings(config_file=config).max_store_bytes is None
    # A variable that is set but lists no token is refused, not read as "auth off".
    for nothing in ("{}", ","):
        monkeypatch.setenv("CACHEKEEPER_TOKENS", nothing)
        with pytest.raises(ConfigInvalid, match="CACHEKEEPER_TOKENS is set but holds no token"):
            load_settings(config_file=config)


@pytest.mark.slow  # a serve process
def test_served_with_an_empty_tokens_variable_auth_stays_on(tmp_path: Path) -> None:
    config = _config(tmp_path, '[tokens]\n"ops-secret" = "admin"\n')
    server = ServerProcess(data_dir=tmp_path / "data", home=tmp_path / "home",
                           args=("--config", str(config)), env={"CACHEKEEPER_TOKENS": ""})  # fmt: skip
    try:
        url = server.start().url
        assert httpx.post(f"{url}/v1/gc", json={"dry_run": True}).status_code == 401
        admin = {"Authorization": "Bearer ops-secret"}
        assert httpx.post(f"{url}/v1/gc", json={"dry_run": True}, headers=admin).status_code == 200
    finally:
        server.kill()


def test_sizes_accept_units(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert parse_size("10GB") == 10_000_000_000
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5 KiB") == 1536
    assert parse_size("2T") == 2 * 10**12 and parse_size("2Ti") == 2 << 40
    assert parse_size(1234) == 1234 and parse_size("1_000") == 1000
    for bad in ("ten", "10 parsecs", "-5", "1e9", True):
        with pytest.raises(ValueError, match="not a size|not a size"):
            parse_size(bad)
    monkeypatch.setenv("CACHEKEEPER_MAX_STORE_BYTES", "10GB")
    config = _config(tmp_path, 'max_blob_bytes = "512MiB"\nmax_manifest_bytes = 1000\n')
    settings = load_settings(config_file=config)
    assert settings.max_store_bytes == 10_000_000_000
    assert settings.max_blob_bytes == 512 << 20 and settings.max_manifest_bytes == 1000


def _error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, env=None, config=None) -> str:  # type: ignore[no-untyped-def]
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    path = _config(tmp_path, config) if config is not None else None
    with pytest.raises(ConfigInvalid) as caught:
        load_settings(config_file=path)
    for name in env or {}:
        monkeypatch.delenv(name)
    message = caught.value.detail
    assert "validation error" not in message and "\n" not in message, message
    return message


def test_config_errors_name_the_setting_its_source_and_value(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    message = _error(monkeypatch, tmp_path, env={"CACHEKEEPER_TOKENS": "sekrit1:raed"})
    assert "CACHEKEEPER_TOKENS" in message and "'raed'" in message
    assert "sekrit1" not in message  # never the token
    message = _error(monkeypatch, tmp_path, env={"CACHEKEEPER_MAX_STORE_BYTES": "10 parsecs"})
    assert "CACHEKEEPER_MAX_STORE_BYTES = '10 parsecs'" in message
    message = _error(monkeypatch, tmp_path, env={"CACHEKEEPER_PORT": "eighty"})
    assert "CACHEKEEPER_PORT = 'eighty'" in message
    message = _error(monkeypatch, tmp_path, config="anonymous_reads = true\n")
    assert "unknown setting 'anonymous_reads'" in message and "'anonymous_read'" in message
    assert str(tmp_path / "server.toml") in message
    message = _error(monkeypatch, tmp_path, config='max_blob_bytes = "lots"\n')
    assert f"max_blob_bytes in {tmp_path / 'server.toml'} = 'lots'" in message
    message = _error(monkeypatch, tmp_path, config='[tokens]\n"sekrit2" = "root"\n')
    assert "tokens in" in message and "'root'" in message and "sekrit2" not in message
    message = _error(monkeypatch, tmp_path, config="max_blob_bytes = \n")
    assert "cannot read config file" in message


def test_a_mistyped_variable_is_named_not_silently_ignored() -> None:
    environ = {
        "CACHEKEEPER_ANONYMOUS_READS": "1",  # the typo
        "CACHEKEEPER_SERVER": "http://cache:8750",  # the client's, not the server's
        "CACHEKEEPER_PORT": "9000",
        "PATH": "/bin",
    }
    assert stray_variables(environ) == [
        "CACHEKEEPER_ANONYMOUS_READS is not a server setting and is ignored"
        " (did you mean CACHEKEEPER_ANONYMOUS_READ?)"
    ]


def test_serve_reports_a_bad_config_in_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path, "anonymous_reads = true\n")
    runner = CliRunner()
    result = runner.invoke(
        cli_main, ["serve", "--data", str(tmp_path / "d"), "--config", str(config)]
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "unknown setting 'anonymous_reads'" in lines[0], result.output
    result = runner.invoke(cli_main, ["serve", "--data", str(tmp_path / "d"), "--token", "x:god"])
    assert result.exit_code == 2 and "--token: token scope 'god'" in result.output


@pytest.mark.slow  # serve processes
def test_an_exposed_server_without_auth_refuses_to_start(tmp_path: Path) -> None:
    runner = CliRunner()
    for host in ("0.0.0.0", "::", "10.1.2.3", "cache.example"):
        result = runner.invoke(cli_main, ["serve", "--host", host, "--data", str(tmp_path / "d")])
        assert result.exit_code == 2, result.output
        assert f"refusing to serve {host} with auth off" in result.output
        assert "--insecure-no-auth" in result.output
    assert not (tmp_path / "d").exists()  # refused before touching anything
    # Asked for explicitly, it starts (bound to every address; probed on loopback).
    server = ServerProcess(data_dir=tmp_path / "data", home=tmp_path / "home", host="0.0.0.0",
                           args=("--insecure-no-auth",))  # fmt: skip
    try:
        server.start()
    finally:
        server.kill()


def _as_non_root() -> list[str] | None:
    """A command prefix that runs without root's override of file permissions, or None.

    As root, ``unshare --user`` drops the capabilities that let root write anywhere (a
    root-owned 0555 dir is then read-only to us, as a root-owned bind mount is to the
    image's non-root user); as anyone else nothing is needed.
    """
    if os.geteuid() != 0:
        return []
    try:
        probe = subprocess.run(["unshare", "--user", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return ["unshare", "--user"] if probe.returncode == 0 else None


@pytest.mark.slow  # three serve processes
def test_an_unusable_data_dir_is_one_line_naming_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a dir")
    sqlite_dir = tmp_path / "meta-is-a-dir"
    (sqlite_dir / "meta.sqlite").mkdir(parents=True)
    cases: list[tuple[list[str], Path, str]] = [
        ([], blocker / "data", "Not a directory"),
        ([], sqlite_dir, "meta.sqlite"),
    ]
    prefix = _as_non_root()
    if prefix is not None:  # the root-owned bind mount case: a dir we may not write
        locked = tmp_path / "read-only"
        locked.mkdir()
        locked.chmod(0o555)
        cases += [(prefix, locked, "Permission denied"), (prefix, locked / "sub", "Permission")]
    for run_as, data, cause in cases:
        proc = subprocess.run(
            [*run_as, sys.executable, "-m", "cachekeeper", "serve", "--data", str(data)],
            env=child_env(tmp_path / "home"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"data dir {data} is not usable" in lines[0] and cause in lines[0], lines[0]


def test_blob_store_must_be_an_s3_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEKEEPER_BLOB_STORE", "/data/blobs")
    with pytest.raises(ConfigInvalid, match="CACHEKEEPER_BLOB_STORE.*s3://BUCKET/PREFIX"):
        load_settings()
    monkeypatch.setenv("CACHEKEEPER_BLOB_STORE", "s3://bucket/prefix")
    assert load_settings().blob_store == "s3://bucket/prefix"
    assert load_settings(blob_store="s3://other/p").blob_store == "s3://other/p"


def test_the_per_key_tiers_settings_are_checked_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEKEEPER_REMOTE_CACHE_MAX_BYTES", "5GiB")
    settings = load_settings(resp_port=6380)
    assert settings.resp_port == 6380 and settings.remote_cache_max_bytes == 5 << 30
    assert settings.remote_cache_writable  # no trust list: write-scope tokens may write
    with pytest.raises(ConfigInvalid, match=r"--resp-port = 70000: 70000 is not a port"):
        load_settings(resp_port=70000)
    monkeypatch.setenv("CACHEKEEPER_REMOTE_CACHE_GET_TIMEOUT_S", "0")
    with pytest.raises(
        ConfigInvalid, match="CACHEKEEPER_REMOTE_CACHE_GET_TIMEOUT_S = '0': 0.0 is not a positive"
    ):
        load_settings()
