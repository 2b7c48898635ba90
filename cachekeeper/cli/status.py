"""``cachekeeper status``: which (workload, environment) pairs are warm, and on which devices.

A table of ``GET /v1/status``: one row per registered workload and builder environment,
its state, the devices its snapshot covers and the agents of that environment. With
``--device`` (the devices the training nodes use, e.g. ``cuda:0-7``), a row whose snapshot
lacks some of them is followed by one line saying which and what to do: the device index
is in Inductor's key, so a builder with fewer GPUs than the nodes cannot build the higher
indices (docs/operations.md, "GPU counts").

A row whose state is out of date says why (``stale``: the workload file changed since its
snapshot was built, or its builder went silent mid-build). A ``--workload`` the server
does not know is an error with a did-you-mean.

A row that training jobs reported on (``cachekeeper prejob`` / ``postjob``) gets a
``jobs:`` line: restores, cold starts by reason, jobs that compiled anyway; and when
restored jobs compiled anyway, a line saying the workload file does not match training.
A job counts in the row of the snapshot it restored (server/catalog/fleet.py).

A ``refused``, ``broken`` or ``failed`` row is followed by the reason its agent reported
(what the allowlist does not admit, the exception, the timeout): before issue 31 only
``--json`` and the page's tooltip had it.
"""

from __future__ import annotations

import click

from cachekeeper.cli._common import (
    device_option,
    emit_json,
    handle_errors,
    json_option,
    open_client,
    printable,
    server_option,
    timeout_option,
    token_option,
)
from cachekeeper.environment.devices import format_devices, requested_devices
from cachekeeper.errors import CachekeeperError, WorkloadNotFound, did_you_mean
from cachekeeper.wire import JobStats, StatusRow, to_dict

__all__ = ["status_cmd"]


@click.command("status")
@server_option
@token_option
@timeout_option
@click.option("--workload", metavar="NAME", help="Only this workload's rows.")
@device_option
@json_option
@handle_errors
def status_cmd(
    server: str | None,
    token: str | None,
    workload: str | None,
    device: str | None,
    as_json: bool,
) -> None:
    """Show which workloads are warm for which builder environments, and on which devices.

    One row per (workload, environment): warm, building, broken, failed, refused or
    missing, the devices the warm snapshot covers, and the agents of that environment; a
    refused, broken or failed row is followed by the reason its agent reported. Then what
    training jobs reported (restores, counted in the row of the snapshot they restored;
    cold starts by reason; jobs that compiled anyway). --device names the devices the
    training nodes use (e.g. cuda:0-7): rows whose snapshot lacks some get a line saying
    which indices were never built and what to do. Needs the read scope.
    """
    try:
        wanted = requested_devices(device)
    except CachekeeperError as exc:
        raise click.BadParameter(exc.detail, param_hint="--device") from exc
    with open_client(server, token) as client:
        rows = client.fleet_status(workload=workload, devices=wanted)
        registered = [] if rows else [w.name for w in client.list_workloads()]
        if not rows and workload is not None and workload not in registered:
            raise WorkloadNotFound(
                f"no workload {workload!r} is registered on {client.base_url}"
                f"{did_you_mean(workload, registered)}"
                f" (registered: {', '.join(registered) or 'none'})"
            )
    if as_json:
        emit_json({"status": [to_dict(row) for row in rows]})
        return
    if not rows:
        click.echo(_nothing_yet(registered))
        return
    click.echo(f"{'workload':<24}{'environment':<14}{'status':<10}{'covers':<14}agents")
    for row in rows:
        covers = format_devices(list(row.devices)) if row.devices else "-"
        agents = ", ".join(row.agents) or "-"
        click.echo(
            f"{row.workload[:23]:<24}{row.fingerprint_digest[:12]:<14}{row.status:<10}"
            f"{covers[:13]:<14}{agents}"
        )
        reason = _reason(row)
        if reason:
            click.echo(f"  ! {row.status}: {reason}")
        if row.stale:
            click.echo(f"  ! stale: {row.stale}")
        if row.note:
            click.echo(f"  ! {row.note}")
        if row.jobs is not None:
            click.echo(f"  jobs: {jobs_line(row.jobs)}")
        if row.jobs_note:
            click.echo(f"  ! {row.jobs_note}")
        if row.jobs is not None and (tier := row.jobs.tier_note) is not None:
            click.echo(f"  {'!' if row.jobs.tier_problems else ' '} {tier}")
        if row.harvest_note:
            click.echo(f"  ! {row.harvest_note}")


def _reason(row: StatusRow) -> str | None:
    """What the agent reported for a refused, broken or failed row (its first line, cut)."""
    if row.status not in ("refused", "broken", "failed") or row.last_event is None:
        return None
    lines = row.last_event.detail.strip().splitlines()
    # the agent's detail may start with its status ("refused: ..."): said once, by the line
    detail = printable(lines[0]).removeprefix(f"{row.last_event.status}: ") if lines else ""
    if not detail:
        return "no reason reported (see --json for the traceback)"
    return detail if len(detail) <= 400 else detail[:397] + "..."


def _nothing_yet(registered: list[str]) -> str:
    """What an empty status means: nothing registered, or nothing built for what is."""
    if not registered:
        return "no workloads registered and no agents seen"
    return (
        f"{len(registered)} workload(s) registered ({', '.join(registered)}), but no agent"
        " has registered and no snapshot of them is stored: start `cachekeeper agent` on a"
        " builder, or `cachekeeper push` a prewarmed dir"
    )


def jobs_line(jobs: JobStats) -> str:
    """``3 restored, 1 cold (no_matching_snapshot 1), 1 of 2 compiled anyway (...)``."""
    parts = [f"{jobs.restores} restored"]
    cold = f"{jobs.cold} cold"
    if jobs.cold_reasons:
        reasons = ", ".join(f"{code} {n}" for code, n in sorted(jobs.cold_reasons.items()))
        cold += f" ({reasons})"
    parts.append(cold)
    if jobs.postjobs:
        parts.append(
            f"{jobs.compiled} of {jobs.postjobs} compiled anyway"
            f" ({jobs.new_graphs} graphs after a restore, {jobs.new_bytes / 1e6:.1f} MB)"
        )
    return ", ".join(parts)
