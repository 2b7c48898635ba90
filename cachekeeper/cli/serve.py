"""``cachekeeper serve``: run the cache server under uvicorn."""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path

import click

from cachekeeper.cli._common import PathParam, echo_err, handle_errors
from cachekeeper.errors import ConfigInvalid

__all__ = ["serve_cmd"]


@click.command("serve")
@click.option("--host", default=None, help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to bind (default 8750).")
@click.option(
    "--data",
    "data_dir",
    type=PathParam(file_okay=False, path_type=Path),
    default=None,
    help="Data dir for metadata and blobs (default $CACHEKEEPER_HOME/server or ~/.cache/cachekeeper/server).",
)
@click.option(
    "--blob-store",
    default=None,
    metavar="s3://BUCKET/PREFIX",
    help="Keep blobs in S3-compatible object storage (AWS_* configuration chain) instead of"
    " <data>/blobs; nodes then download and upload directly with presigned URLs.",
)
@click.option(
    "--resp-port",
    type=int,
    default=None,
    metavar="PORT",
    help="Also serve the per-key tier (torch's remote FX graph, AOTAutograd, autotune and"
    " PGO caches, through redis-py) on this port of --host [default: off].",
)
@click.option(
    "--config",
    "config_file",
    type=PathParam(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="TOML config file (keys as in Settings: tokens, max_store_bytes, ...).",
)
@click.option(
    "--token",
    "tokens",
    multiple=True,
    metavar="TOKEN:SCOPE",
    help="Add a bearer token with scope read|write|admin (repeatable). Prefer CACHEKEEPER_TOKENS.",
)
@click.option(
    "--anonymous-read/--no-anonymous-read", default=None, help="Allow read routes without a token."
)
@click.option(
    "--insecure-no-auth",
    is_flag=True,
    default=None,
    help="Serve a non-loopback address (0.0.0.0, ...) with no tokens, open to anyone who can reach it.",
)
@click.option(
    "--serve-harvested/--no-serve-harvested",
    default=None,
    help="Offer harvested deltas (postjob --push) after their parent snapshot [default: off].",
)
@click.option(
    "--tls-cert",
    type=PathParam(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Serve https with this certificate chain (PEM); needs --tls-key.",
)
@click.option(
    "--tls-key",
    type=PathParam(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="The private key (PEM) of --tls-cert.",
)
@click.option(
    "--metrics-public/--no-metrics-public",
    default=None,
    help="Answer /metrics without a token [default: it needs the read scope, since its"
    " labels name workloads].",
)
@handle_errors
def serve_cmd(
    host: str | None,
    port: int | None,
    data_dir: Path | None,
    blob_store: str | None,
    resp_port: int | None,
    config_file: Path | None,
    tokens: tuple[str, ...],
    anonymous_read: bool | None,
    insecure_no_auth: bool | None,
    serve_harvested: bool | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    metrics_public: bool | None,
) -> None:
    """Run the cache server (FastAPI under uvicorn) until interrupted.

    Settings come from these options, then CACHEKEEPER_* environment variables, then the
    --config file. With no tokens configured, every route is open, which is refused on a
    non-loopback address unless --insecure-no-auth is given. One server per --data dir: a
    second one on the same dir refuses to start (it holds <data>/server.lock).
    """
    # Server packages load only for `serve`: the hook's start-up never pays for them, and
    # the base install (training nodes, builders) does not have them.
    try:
        import uvicorn

        from cachekeeper.server.app import create_app  # optional: needs cachekeeper[server]
        from cachekeeper.server.connections import bounded_http  # same
        from cachekeeper.server.data_lock import lock_data_dir  # same
        from cachekeeper.server.settings import (  # same
            check_data_dir,
            is_loopback,
            load_settings,
            parse_tokens,
            stray_variables,
        )
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] == "cachekeeper":
            raise
        echo_err(
            f"error: 'cachekeeper serve' needs the server's packages ({exc.name} is not "
            "installed): pip install 'cachekeeper[server]'"
        )
        sys.exit(1)

    try:
        flag_tokens = parse_tokens(",".join(tokens)) if tokens else None
    except ValueError as exc:
        raise ConfigInvalid(f"--token: {exc}") from exc
    settings = load_settings(
        config_file=config_file,
        host=host,
        port=port,
        data_dir=data_dir,
        blob_store=blob_store,
        resp_port=resp_port,
        anonymous_read=anonymous_read,
        insecure_no_auth=insecure_no_auth,
        serve_harvested=serve_harvested,
        tokens=flag_tokens,
        tls_cert=tls_cert,
        tls_key=tls_key,
        metrics_public=metrics_public,
    )
    for warning in stray_variables(os.environ):
        echo_err(f"warning: {warning}")
    check_data_dir(settings.data_dir)
    # Held until this process ends: a second server on this --data stops here, in one line.
    _lock, lock_warning = lock_data_dir(settings.data_dir)
    if lock_warning is not None:
        echo_err(f"warning: {lock_warning}")
    try:
        app = create_app(settings)
    except sqlite3.Error as exc:
        meta = settings.data_dir / "meta.sqlite"
        raise ConfigInvalid(f"data dir {settings.data_dir} is not usable: {meta}: {exc}") from exc
    except OSError as exc:
        raise ConfigInvalid(f"data dir {settings.data_dir} is not usable: {exc}") from exc
    resp = app.state.resp
    tier = "" if resp is None else f", per-key tier on port {resp.start()}"
    click.echo(
        f"cachekeeper server on {settings.scheme}://{settings.host}:{settings.port}"
        f" (data {settings.data_dir}, blobs {settings.blob_store or settings.data_dir / 'blobs'},"
        f" auth {'on' if settings.auth_enabled else 'off'}{tier})",
        err=True,
    )
    if settings.auth_enabled and settings.scheme == "http" and not is_loopback(settings.host):
        echo_err(
            "warning: bearer tokens travel in clear text over http: serve --tls-cert/--tls-key,"
            " or put a TLS reverse proxy in front (docs/server.md)"
        )
    try:
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            ssl_certfile=settings.tls_cert,
            ssl_keyfile=settings.tls_key,
            **bounded_http(settings),  # header time, a connection cap, the open-file limit raised
        )
    finally:
        if resp is not None:
            resp.stop()  # stores what is queued
