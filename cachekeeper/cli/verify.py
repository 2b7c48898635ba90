"""``cachekeeper verify``: a thin adapter over cachekeeper.builder.verify.

Exit codes: 0 verified effective, 1 not effective, 2 error (bad workload, bad device,
a child that crashed or timed out).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from cachekeeper.builder.report_text import format_verify
from cachekeeper.builder.verify import verify
from cachekeeper.builder.workload import load_workload
from cachekeeper.cli._common import (
    PathParam,
    device_option,
    emit_json,
    handle_errors,
    json_option,
    server_option,
    token_option,
)
from cachekeeper.cli.prewarm import progress_to_stderr, run_with_site_switches
from cachekeeper.environment.devices import select_devices
from cachekeeper.environment.fingerprint import visible_gpus
from cachekeeper.restore.marker import recorded_conflicts
from cachekeeper.store import LocalStore

__all__ = ["verify_cmd"]


@click.command(name="verify")
@click.argument("workload", type=PathParam(dir_okay=False, path_type=Path))
@click.option(
    "--cache-dir",
    required=True,
    type=PathParam(file_okay=False, path_type=Path),
    help="The Inductor cache dir to check.",
)
@device_option
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=None,
    help="Seconds each child, and each run of a [[command]], may take.",
)
@server_option
@token_option
@json_option
@handle_errors
def verify_cmd(
    workload: Path,
    cache_dir: Path,
    device: str | None,
    timeout_s: float | None,
    server: str | None,
    token: str | None,
    as_json: bool,
) -> None:
    """Prove a cache dir is effective for WORKLOAD: run it in a fresh process per device.

    Effective only with zero FX-graph misses and bypasses, zero AOTAutograd misses and at
    least one hit. Exit 0 when effective, 1 when not, 2 on error. A run that misses
    compiles what it misses, and Inductor adds those entries to the cache dir. A
    [[command]] runs in a fresh copy of the cache dir instead (the dir is not written),
    and every process that compiled must be effective; the report names each rank. When
    it is not effective, files a restore kept because they differ from its snapshot
    (corrupt entries) are named, with the `restore --repair` that replaces them. With a
    server that serves the per-key tier, it runs with the tier's switches, as prewarm does.
    """
    parsed = load_workload(workload)
    run_with_site_switches(server, token, what="verify")
    report = verify(
        parsed,
        cache_dir,
        devices=select_devices(device, visible=visible_gpus),
        timeout_s=timeout_s,
        progress=progress_to_stderr,  # stderr even with --json: stdout is the report
    )
    # A miss in a restored dir may be no fault of the workload: a restore kept files that
    # differ from its snapshot (a corrupt entry), which then miss. Name them.
    corrupt = {} if report.effective else recorded_conflicts(cache_dir)
    if as_json:
        emit_json({**report.to_dict(), "conflicts": corrupt})
    else:
        click.echo(format_verify(report))
        local = {s.id for s in LocalStore().list()} if corrupt else set()
        for snapshot_id, files in corrupt.items():
            names = ", ".join(sorted(files)[:5]) + (", ..." if len(files) > 5 else "")
            what = snapshot_id[:12] if snapshot_id in local else f"ARCHIVE_OF_{snapshot_id[:12]}"
            click.echo(
                f"  {len(files)} file(s) of snapshot {snapshot_id[:12]} in {cache_dir} differ"
                f" from its manifest (corrupt entries? a restore kept them): {names}; replace"
                f" them: cachekeeper restore {what} --cache-dir {cache_dir} --repair"
            )
    sys.exit(report.exit_code)
