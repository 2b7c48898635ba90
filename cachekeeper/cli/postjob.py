"""``cachekeeper postjob``: after the job, count what it compiled on top of the restore.

As light as ``prejob`` on purpose (the same epilog budget): click, the fingerprint's
torch-free collector, a directory walk and one stdlib HTTP request.
"""

from __future__ import annotations

from pathlib import Path

import click

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
from cachekeeper.cli.keys import sign_key_option
from cachekeeper.client.calls import redact_url
from cachekeeper.client.postjob import REPORT_TIMEOUT_S, postjob, summary_line
from cachekeeper.environment.devices import requested_devices
from cachekeeper.errors import CachekeeperError

__all__ = ["postjob_cmd"]


@click.command("postjob")
@click.option(
    "--workload", required=True, metavar="NAME", help="The workload the job's prejob restored."
)
@click.option(
    "--cache-dir",
    type=PathParam(path_type=Path),  # a file here is a one-line error, not a usage error
    help="Cache dir the job used (default: as prejob's: $TORCHINDUCTOR_CACHE_DIR, else the "
    "persistent per-environment dir).",
)
@server_option
@token_option
@device_option
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=REPORT_TIMEOUT_S,
    show_default=True,
    help="Give up (fingerprint and report) after this many seconds in all.",
)
@click.option(
    "--strict", is_flag=True, help="Exit non-zero when nothing could be counted or reported."
)
@click.option("--no-report", is_flag=True, help="Count and print only; tell the server nothing.")
@click.option(
    "--push",
    is_flag=True,
    help="Also upload what the job compiled as a harvested delta of the restored snapshot "
    "(write scope; unverified; served only by a server run with --serve-harvested, or once an"
    " agent's own rebuild of a workload with a [[command]] compiles the same entries; the line"
    " says which).",
)
@sign_key_option
@json_option
@handle_errors
def postjob_cmd(
    workload: str,
    cache_dir: Path | None,
    server: str | None,
    token: str | None,
    device: str | None,
    timeout_s: float,
    strict: bool,
    no_report: bool,
    push: bool,
    sign_key: Path | None,
    as_json: bool,
) -> None:
    """Post-job hook: count what the job compiled on top of the restored snapshot; report it.

    Compares the cache dir with the snapshot prejob restored there (and what an earlier
    postjob counted) and counts the new FX-graph, AOTAutograd and Triton entries and their
    bytes. Prints one line (--json: a report) and reports to the server (POST /v1/reports).
    A job that compiled graphs (FX-graph or AOTAutograd entries) on top of a restored
    snapshot means the workload file does not match training (see cachekeeper explain); a
    Triton kernel or an autotune result alone after every graph hit is benign, and the line
    says so. Never deletes anything and never fails the
    job: exits 0 whatever happens, unless --strict. With --push, what the job compiled is
    uploaded as a harvested delta (unverified, source=harvest) parented on the restored
    snapshot; a server run with --serve-harvested offers it to later prejobs after it.
    """
    try:
        devices = requested_devices(device) if device else None
    except CachekeeperError as exc:
        raise click.BadParameter(exc.detail, param_hint="--device") from exc
    report = postjob(
        workload=workload,
        server=server,
        token=token,
        cache_dir=cache_dir,
        devices=devices,
        report=not no_report,
        timeout_s=timeout_s,
        push=push,
        sign_key=sign_key,
    )
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(summary_line(report))
        if report.tier is not None:
            click.echo(f"cachekeeper: postjob: {report.tier.line()}")
    if report.warning:
        echo_err(f"cachekeeper: postjob: {report.warning}")
    if report.unknown_workload:
        echo_err(f"cachekeeper: postjob: error: {report.unknown_workload}; the report counts"
                 " in no status row (check --workload)")  # fmt: skip
    unreported = not no_report and bool(server) and not report.reported
    if unreported and report.error is None:
        shown = redact_url(server or "")
        echo_err(f"cachekeeper: postjob: the server at {shown} did not take the report")
    if strict and (report.error is not None or unreported or report.unknown_workload):
        raise SystemExit(1)
