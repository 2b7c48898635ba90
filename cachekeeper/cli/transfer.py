"""Transfer commands: ``push``, ``pull`` and ``prejob`` move snapshots to and from the server.

They share the server/token, workload, driver-policy and device options, and the rule below.

Kept light on purpose: ``prejob`` runs before every training job, so this module imports
click and the hook (``cachekeeper.client.prejob``) at load time; the push and pull client
code and rich (for push's progress bar) are imported inside the commands that use them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from cachekeeper.cli._common import (
    PathParam,
    describe_os_error,
    device_option,
    echo_err,
    emit_json,
    handle_errors,
    json_option,
    mb,
    server_option,
    token_option,
)
from cachekeeper.cli.keys import sign_key_option, trust_option, trust_paths, trusted_keys
from cachekeeper.client.prejob import cold_line, export_lines, prejob, write_env_file
from cachekeeper.environment.devices import requested_devices
from cachekeeper.errors import CachekeeperError

__all__ = ["push_cmd", "pull_cmd", "prejob_cmd"]

workload_option = click.option(
    "--workload", required=True, metavar="NAME", help="The workload name the snapshot is for."
)
driver_policy_option = click.option(
    "--driver-policy",
    type=click.Choice(["newer", "exact", "any"]),
    default="newer",
    show_default=True,
    help="Which builder drivers this node accepts (newer: not newer than this node's).",
)
# The deprecated spelling of --device (pull and prejob took a list of cuda:N before every
# command shared --device's grammar). Still accepted; a note on stderr says so.
devices_option = click.option(
    "--devices", metavar="LIST", help="Deprecated spelling of --device (cuda:0,cuda:1)."
)


def _devices(device: str | None, devices: str | None) -> list[str] | None:
    """The devices the job will use, from --device (or the deprecated --devices)."""
    if devices is None:
        try:
            return requested_devices(device)
        except CachekeeperError as exc:
            raise click.BadParameter(exc.detail, param_hint="--device") from exc
    if device is not None:
        raise click.UsageError("pass --device only (--devices is its deprecated spelling)")
    echo_err("cachekeeper: --devices is deprecated; use --device (e.g. --device cuda:0,1)")
    out = [d.strip() for d in devices.split(",") if d.strip()]
    for d in out:
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()):
            raise click.BadParameter(f"{d!r} is not 'cpu' or 'cuda:N'", param_hint="--devices")
    return out or None


def _require_server(server: str | None) -> str:
    if not server:
        raise click.UsageError("no server: pass --server URL or set CACHEKEEPER_SERVER")
    return server


@click.command("push")
@click.argument("cache_dir", type=PathParam(exists=True, file_okay=False, path_type=Path))
@workload_option
@server_option
@token_option
@click.option("--workers", default=4, show_default=True, help="Uploads in flight at once.")
@click.option(
    "--allow-unregistered",
    is_flag=True,
    help="Publish even if the server has no workload of that name registered.",
)
@click.option(
    "--publish-timeout",
    "publish_timeout_s",
    type=click.FloatRange(min=1.0),
    default=None,
    metavar="SECONDS",
    help="How long to wait for the server to check and pack the snapshot at publish "
    "(default: 30 s plus 1 s per 2 MiB and 20 ms per blob).",
)
@click.option(
    "--allow-empty",
    is_flag=True,
    help="Publish even when CACHE_DIR holds no file a snapshot takes (default: refused,"
    " naming what was scanned: an empty dir is most often the wrong one).",
)
@sign_key_option
@json_option
@handle_errors
def push_cmd(
    cache_dir: Path,
    workload: str,
    server: str | None,
    token: str | None,
    workers: int,
    allow_unregistered: bool,
    publish_timeout_s: float | None,
    allow_empty: bool,
    sign_key: Path | None,
    as_json: bool,
) -> None:
    """Snapshot CACHE_DIR and upload it to the server as a snapshot of --workload NAME.

    Only blobs the server lacks are uploaded (several at once, zstd-compressed); pushing
    the same dir again uploads nothing. Prints what was uploaded and deduplicated.

    NAME must be registered on the server (PUT /v1/workloads/NAME), unless
    --allow-unregistered. The snapshot is verified only when a `cachekeeper prewarm` of
    that same workload verified CACHE_DIR; otherwise it is published unverified, and a
    warning on stderr says why. A CACHE_DIR with no file a snapshot takes is refused
    (one line saying what was scanned), unless --allow-empty.

    A server whose blobs are in an object store checks every blob and packs the
    snapshot's archive before it answers the publish; for a large snapshot a line on
    stderr says so, and how long the push waits (--publish-timeout).
    """
    from cachekeeper.client.api import CacheClient  # hook start-up: prejob shares this module
    from cachekeeper.client.push import push  # hook start-up: snapshot code, not for prejob

    publishing = _PublishNote()
    with CacheClient(base_url=_require_server(server), token=token) as client:
        with _progress_bar(enabled=not as_json and sys.stderr.isatty()) as progress:
            report = push(
                cache_dir,
                client=client,
                workload=workload,
                workers=workers,
                progress=progress,
                sign_key=sign_key,
                require_registered=not allow_unregistered,
                publish_timeout_s=publish_timeout_s,
                on_publish=publishing.start,
                allow_empty=allow_empty,
            )
    publishing.done()
    if report.unverified_reason is not None:
        echo_err(
            f"warning: snapshot {report.snapshot_id[:12]} is published unverified: "
            f"{report.unverified_reason}"
        )
    if as_json:
        emit_json(report.to_dict())
        return
    state = "published" if report.created else "already published"
    verified = "verified" if report.verified else "unverified"
    click.echo(
        f"snapshot {report.snapshot_id} {state} for workload {report.workload!r} ({verified})"
    )
    click.echo(
        f"  uploaded     {report.uploaded_blobs} blobs, {mb(report.uploaded_bytes)} "
        f"({mb(report.uploaded_wire_bytes)} compressed)"
    )
    click.echo(f"  deduplicated {report.deduplicated_blobs} blobs, {mb(report.deduplicated_bytes)}")


class _PublishNote:
    """A line on stderr before a long publish, and one saying how long it took."""

    LONG_BYTES = 64 << 20  # snapshots this big get the lines

    def __init__(self) -> None:
        self._started_at: float | None = None

    def start(self, blob_bytes: int, blob_count: int, waits_s: float) -> None:
        if blob_bytes < self.LONG_BYTES:
            return
        self._started_at = time.monotonic()
        echo_err(
            f"cachekeeper: publishing {mb(blob_bytes)} in {blob_count} blobs; a server with an "
            f"object store reads them all back first (waiting up to {waits_s:.0f} s)"
        )

    def done(self) -> None:
        if self._started_at is not None:
            elapsed = time.monotonic() - self._started_at
            echo_err(f"cachekeeper: publishing: done in {elapsed:.1f} s")


class _progress_bar:
    """A rich progress bar on stderr, or nothing (rich is imported only when shown)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

        self._progress = Progress(
            *Progress.get_default_columns(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task("uploading", total=None)

        def update(done: int, total: int) -> None:
            self._progress.update(self._task, completed=done, total=total)

        return update

    def __exit__(self, *exc_info: object) -> None:
        if self._progress is not None:
            self._progress.stop()


@click.command("pull")
@workload_option
@click.option(
    "--cache-dir",
    required=True,
    type=PathParam(file_okay=False, path_type=Path),
    help="The Inductor cache dir to restore into (created if missing).",
)
@server_option
@token_option
@driver_policy_option
@device_option
@devices_option
@click.option("--timeout", "timeout_s", type=float, default=None, help="Overall limit (s).")
@trust_option
@json_option
@handle_errors
def pull_cmd(
    workload: str,
    cache_dir: Path,
    server: str | None,
    token: str | None,
    driver_policy: str,
    device: str | None,
    devices: str | None,
    timeout_s: float | None,
    trust: tuple[Path, ...],
    as_json: bool,
) -> None:
    """Fetch and restore the snapshot of --workload NAME that matches this node.

    Only files the dir lacks are downloaded (one archive stream); nothing already in the
    dir is touched. Fails with the field-by-field difference when nothing matches. With
    a trust list (--trust or CACHEKEEPER_TRUSTED_KEYS), a snapshot not signed by one of
    those keys is refused and nothing is written.
    """
    from cachekeeper.client.api import CacheClient, Deadline  # hook start-up (as in push)
    from cachekeeper.client.pull import pull  # hook start-up: restore code, not for a no-op

    trusted = trusted_keys(trust)
    with CacheClient(base_url=_require_server(server), token=token) as client:
        report = pull(
            client=client,
            workload=workload,
            cache_dir=cache_dir,
            driver_policy=driver_policy,
            devices=_devices(device, devices),
            deadline=Deadline(timeout_s),
            trusted_keys=trusted,
        )
    if as_json:
        emit_json(report.to_dict())
    elif report.outcome == "already_restored":
        click.echo(f"{report.cache_dir} already holds snapshot {report.snapshot_id}")
    else:
        click.echo(
            f"restored snapshot {report.snapshot_id} into {report.cache_dir} "
            f"({report.blobs_fetched} blobs fetched)"
        )


@click.command("prejob")
@workload_option
@click.option(
    "--cache-dir",
    type=PathParam(path_type=Path),  # a file here is the hook's cold start, not a usage error
    help="Cache dir (default: $TORCHINDUCTOR_CACHE_DIR, else a persistent "
    "~/.cache/cachekeeper/inductor/<fingerprint>/ dir, under $CACHEKEEPER_HOME when set).",
)
@server_option
@token_option
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Give up (and compile cold) after this many seconds in all.",
)
@click.option("--strict", is_flag=True, help="Exit non-zero when no cache was restored.")
@click.option(
    "--env-file",
    type=PathParam(dir_okay=False, path_type=Path),
    help="Also write the export lines to this file (atomically).",
)
@driver_policy_option
@device_option
@devices_option
@trust_option
@click.option(
    "--no-report",
    is_flag=True,
    help="Do not report the outcome to the server (POST /v1/reports).",
)
@click.option(
    "--remote-cache/--no-remote-cache",
    default=None,
    help="Whether the job uses the server's per-key tier (torch's remote caches) when it"
    " offers one [default: the server's remote_cache_default].",
)
@click.option(
    "--tier-backend",
    type=click.Choice(["auto", "cachekeeper", "redis"]),
    default="auto",
    show_default=True,
    help="How the job reaches the per-key tier: cachekeeper's own backend (loaded into the"
    " job's Python processes through PYTHONPATH; no redis-py; a tier that fails costs the job"
    " one deadline), or torch's stock redis-py path (for jobs whose processes do not inherit"
    " the exports, e.g. a container that resets PYTHONPATH). auto: cachekeeper's for a torch"
    " it was checked against (2.11-2.15), else redis.",
)
@click.option(
    "--tier-timeout",
    "tier_timeout_s",
    type=click.FloatRange(min=0.01, max=60.0),
    default=None,
    metavar="SECONDS",
    help="The deadline of each call of cachekeeper's tier backend [default: 0.8], plus the"
    " time a value's size needs at 50 MB/s.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON report on stdout instead of the export lines.",
)
@handle_errors
def prejob_cmd(
    workload: str,
    cache_dir: Path | None,
    server: str | None,
    token: str | None,
    timeout_s: float,
    strict: bool,
    env_file: Path | None,
    driver_policy: str,
    device: str | None,
    devices: str | None,
    trust: tuple[Path, ...],
    no_report: bool,
    remote_cache: bool | None,
    tier_backend: str,
    tier_timeout_s: float | None,
    as_json: bool,
) -> None:
    """Pre-job hook: restore this node's cache of --workload NAME; print the env to export.

    Use it as eval "$(cachekeeper prejob --workload NAME)". It never fails the job: when
    the server is down, slow, refuses, or has no matching snapshot, it prints one line on
    stderr saying why, still prints the exports, and exits 0 (non-zero with --strict).
    With a trust list (--trust or CACHEKEEPER_TRUSTED_KEYS), an unsigned, untrusted or
    tampered snapshot is not restored: that too is a cold start with its reason.
    An --env-file that cannot be written is one line on stderr; the exports still go to
    stdout (with --strict it exits 1). The outcome (restored, or cold and why) is reported
    to the server, best-effort (--no-report: not). When the server serves the per-key
    tier, the exports also switch torch's remote caches on against it (--no-remote-cache:
    not), through cachekeeper's own backend or torch's redis-py path (--tier-backend), and
    one line on stderr says which, and whether the job writes to it (a read token: reads
    only). A node with a trust list gets no tier (its values are not signed).
    """
    report = prejob(
        workload=workload,
        server=server,
        token=token,
        cache_dir=cache_dir,
        timeout_s=timeout_s,
        driver_policy=driver_policy,
        devices=_devices(device, devices),
        trust=trust_paths(trust),
        report=not no_report,
        remote_cache={None: "auto", True: "on", False: "off"}[remote_cache],
        tier_backend=tier_backend,
        tier_timeout_s=tier_timeout_s,
    )
    lines = export_lines(report.exports)
    if report.remote_cache == "off" and remote_cache is not False:
        echo_err(
            f"cachekeeper: the per-key tier is off for this job ({report.remote_cache_reason})"
        )
    elif report.remote_cache_note is not None:
        echo_err(f"cachekeeper: {report.remote_cache_note}")
    for problem in report.delta_problems:
        echo_err(f"cachekeeper: a harvested delta was not restored: {problem}")
    if report.conflicts:
        echo_err(
            f"cachekeeper: warning: {len(report.conflicts)} file(s) in {report.cache_dir} differ"
            f" from snapshot {(report.snapshot_id or '')[:12]} and were kept as they were"
            f" (first: {report.conflicts[0]}); check who changed them"
        )
    if report.cold:
        echo_err(
            cold_line(report.reason or "unknown reason", held_snapshot_id=report.held_snapshot_id)
        )
        if strict:
            if as_json:
                emit_json(report.to_dict())
            sys.exit(report.error.exit_code if report.error is not None else 1)
    elif report.outcome == "restored":
        echo_err(
            f"cachekeeper: restored snapshot {report.snapshot_id} into {report.cache_dir} "
            f"({report.blobs_fetched} blobs) in {report.elapsed_s:.1f} s"
        )
    if env_file is not None:
        try:
            write_env_file(env_file, lines)
        except OSError as exc:  # the job must not fail because the env file cannot be written
            cause = exc.strerror or describe_os_error(exc)  # the file, not its temp sibling
            echo_err(f"cachekeeper: cannot write the env file {env_file}: {cause}")
            if strict:
                sys.exit(1)
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(lines, nl=False)
