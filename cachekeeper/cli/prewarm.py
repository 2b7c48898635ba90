"""``cachekeeper prewarm``: a thin adapter over cachekeeper.builder.prewarm.

Exit codes: 0 verified effective, 1 not effective, 2 error (bad workload, bad device,
a cache dir it cannot fill, found before compiling; a child that crashed or timed out; a
command that failed before compiling anything), 3 cold compile broken.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from cachekeeper import remote_tier
from cachekeeper.builder.prewarm import prewarm
from cachekeeper.builder.report_text import format_prewarm
from cachekeeper.builder.workload import load_workload
from cachekeeper.cli._common import (
    PathParam,
    device_option,
    echo_err,
    emit_json,
    handle_errors,
    json_option,
    server_option,
    token_option,
)
from cachekeeper.environment.devices import select_devices
from cachekeeper.environment.fingerprint import visible_gpus
from cachekeeper.errors import CacheDirUnusable, CachekeeperError

__all__ = ["prewarm_cmd", "progress_to_stderr", "run_with_site_switches"]


def run_with_site_switches(server: str | None, token: str | None, *, what: str) -> None:
    """Make this process (and so its children and its fingerprint) run with the per-key
    tier's switches of ``server``, as the agent does: one of them is in torch's keys, so a
    cache prewarmed by hand without them leaves every node with the tier on without the
    AOTAutograd half of the tier. No server: as before. A server that cannot be asked: one
    line, and this environment's switches."""
    if not server:
        return
    from cachekeeper.client.api import CacheClient  # a server is named: the HTTP client
    from cachekeeper.client.calls import redact_url

    try:
        with CacheClient(base_url=server, token=token, timeout_s=10.0) as client:
            offer = client.remote_cache()
    except CachekeeperError as exc:
        echo_err(
            f"cachekeeper: {what}: cannot ask {redact_url(server)} for the per-key tier's"
            f" switches ({exc.detail}); running with this environment's"
        )
        return
    remote_tier.set_builder_switches(os.environ, {} if offer is None else offer.switches)
    if offer is not None:
        keyed = ", ".join(sorted(remote_tier.key_switches(offer.switches))) or "none"
        echo_err(
            f"cachekeeper: {what}: running with the per-key tier's switches of"
            f" {redact_url(server)}, as nodes with the tier on do (in torch's keys: {keyed})"
        )


def progress_to_stderr(event: object) -> None:
    echo_err(event.describe())  # type: ignore[attr-defined]


@click.command(name="prewarm")
@click.argument("workload", type=PathParam(dir_okay=False, path_type=Path))
@click.option(
    "--cache-dir",
    required=True,
    type=PathParam(file_okay=False, path_type=Path),
    help="The Inductor cache dir to fill (TORCHINDUCTOR_CACHE_DIR of the training job).",
)
@device_option
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=None,
    help="Seconds each child, and each run of a [[command]], may take (a command's own"
    " timeout applies too; the shorter wins).",
)
@server_option
@token_option
@json_option
@handle_errors
def prewarm_cmd(
    workload: Path,
    cache_dir: Path,
    device: str | None,
    timeout_s: float | None,
    server: str | None,
    token: str | None,
    as_json: bool,
) -> None:
    """Cold-compile WORKLOAD on each device in fresh processes, merge into the cache dir
    and verify it.

    Each device compiles into an empty staging dir first; a cold compile that raises is
    reported with its traceback, nothing is merged, and the exit code is 3. Each
    [[command]] runs once as it is (its launcher picks its own devices: --device does not
    apply to it), then again in a fresh copy of the cache dir, where every rank must hit;
    a command that exits non-zero on the cold run is cold_compile_broken (exit 3), or
    command_failed (exit 2) when it compiled nothing (a usage error: its first error line
    is in the report). A cache
    dir it could not fill (read-only, immutable, not ours) is found before anything is
    compiled: one line naming it, exit 2. Progress goes
    to stderr (also with --json, whose report is all stdout holds). Exit 0 when the merged cache verifies effective, 1 when it does not.

    With a server (--server or CACHEKEEPER_SERVER) that serves the per-key tier, the
    children run with its switches, as the agent's do (one is in torch's keys: nodes with
    the tier on then hit every entry); a line on stderr says so.
    """
    parsed = load_workload(workload)
    run_with_site_switches(server, token, what="prewarm")
    try:
        report = prewarm(
            parsed,
            cache_dir,
            devices=select_devices(device, visible=visible_gpus),
            progress=progress_to_stderr,  # stderr even with --json: stdout is the report
            timeout_s=timeout_s,
        )
    except CacheDirUnusable as exc:  # exit 2, an error: prewarm's 1 means "not effective"
        echo_err(f"error: {exc.detail} [{exc.code}]")
        sys.exit(2)
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(format_prewarm(report))
    sys.exit(report.exit_code)
