"""``cachekeeper agent``: the builder daemon, a thin adapter over ``cachekeeper.builder.agent``.

Exit codes: 0 after ``--once`` when every workload is warm or its outcome (built, broken,
failed) was reported, and after SIGTERM/SIGINT; 1 when the server cannot be reached or
refuses the agent (``--once`` only: the daemon keeps retrying); 2 on usage errors (a bad
option, a device that is not visible).
"""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime
from pathlib import Path

import click

from cachekeeper import config
from cachekeeper.builder.agent import (
    DEFAULT_BUILD_TIMEOUT_S,
    AgentOptions,
    RoundReport,
    StopSignal,
    run_agent,
)
from cachekeeper.builder.allowlist import Allowlist
from cachekeeper.cli._common import (
    PathParam,
    device_option,
    echo_err,
    handle_errors,
    json_option,
    server_option,
    token_option,
)
from cachekeeper.cli.keys import sign_key_option
from cachekeeper.client.api import CacheClient
from cachekeeper.environment.devices import select_devices
from cachekeeper.environment.fingerprint import visible_gpus

__all__ = ["agent_cmd"]


@click.command(name="agent")
@server_option
@token_option
@device_option
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(min=1.0),
    default=300.0,
    show_default=True,
    help="Seconds between rounds.",
)
@click.option("--once", is_flag=True, help="Run one round and exit.")
@click.option(
    "--work-dir",
    type=PathParam(file_okay=False, path_type=Path),
    default=None,
    help="Where builds are staged (removed after each) [default: $CACHEKEEPER_HOME/agent].",
)
@click.option(
    "--build-timeout",
    "build_timeout_s",
    type=click.FloatRange(min=1.0),
    default=DEFAULT_BUILD_TIMEOUT_S,
    show_default=True,
    help="Seconds each prewarm or verify child, and each run of a workload's command, may"
    " run before it is killed (a command's own shorter timeout wins); the workload is then"
    " reported failed with a 'timeout:' detail and the agent carries on.",
)
@click.option(
    "--name",
    default=None,
    help="This agent's name on the server [default: the host name].",
)
@click.option(
    "--allow",
    "allow",
    multiple=True,
    metavar="ENTRY",
    help="Code this builder may run: an import pattern (mytrainer.*, mytrainer.warmup:step),"
    " or a command line whose words are its program (a path, or a name on PATH) and one"
    " glob per argument, '...' last for any further ones ('/opt/venv/bin/torchrun"
    " --nproc-per-node [1-8] -m mytrainer.train ...'); it admits no env and no cwd (use"
    " --allow-file). Repeatable. Without any, workloads with a [[command]], an"
    " [[entrypoint]] or a pkg.mod:factory are refused (docs/security.md).",
)
@click.option(
    "--allow-file",
    "allow_files",
    multiple=True,
    type=PathParam(dir_okay=False, exists=True, path_type=Path),
    help="A file of entries: *.toml holds imports = [...] and [[command]] tables (program,"
    " args, rest, env, cwd: docs/security.md); any other name, one --allow entry per line"
    " ('#' starts a comment). Repeatable.",
)
@click.option(
    "--unconfined-builds",
    is_flag=True,
    help="With --sign-key on a host where builds cannot be kept from the key (no Landlock),"
    " build and sign anyway: the code you admit can then read the key. Without it, such"
    " an agent refuses to start.",
)
@sign_key_option
@json_option
@handle_errors
def agent_cmd(
    server: str | None,
    token: str | None,
    device: str | None,
    interval_s: float,
    once: bool,
    work_dir: Path | None,
    build_timeout_s: float,
    name: str | None,
    allow: tuple[str, ...],
    allow_files: tuple[Path, ...],
    unconfined_builds: bool,
    sign_key: Path | None,
    as_json: bool,
) -> None:
    """Keep every workload registered on the server warm for this node's environment.

    The token needs the write scope (the agent registers, reports and pushes).

    Each round re-reads this node's fingerprint, registers it, and for each registered
    workload without a verified snapshot for this fingerprint and these devices: prewarms
    it on every device (fresh processes, cold), verifies, pushes, and reports the outcome
    (see GET /v1/status). Workloads that are already warm compile nothing. A workload that
    crashes, hangs past --build-timeout or whose cold compile raises is reported and the
    agent carries on. A workload whose code (a command, an entrypoint, a mask or score
    factory) no --allow entry admits runs nothing and is reported 'refused'. Every build's
    process tree is reaped when it ends, and with --sign-key the key is read once at start
    and hidden from every build (Landlock); only a verified snapshot this key signed counts
    as warm. A warm command workload's harvested deltas (postjob --push) are a hint, never
    loaded or signed here: the agent builds the workload again in a fresh dir and publishes
    its own build when that compiled harvested entries the snapshot lacks; the rest are
    reported kept back. SIGTERM abandons the current build (nothing half-pushed) and exits 0.
    Progress goes to stderr, each line stamped with the UTC time; --json prints each
    round's report on stdout.
    """
    if not server:
        raise click.UsageError("no server: pass --server URL or set CACHEKEEPER_SERVER")
    try:
        allowlist = Allowlist.load(allow, allow_files)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--allow") from exc
    options = AgentOptions(
        devices=tuple(select_devices(device, visible=visible_gpus)),
        work_dir=(work_dir or config.agent_work_dir(os.environ)).absolute(),
        name=name or socket.gethostname(),
        build_timeout_s=build_timeout_s,
        sign_key=sign_key.absolute() if sign_key else None,
        allow=allowlist,
        unconfined=unconfined_builds,
    )

    def log(line: str) -> None:
        echo_err(f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ} {line}")

    def on_round(report: RoundReport) -> None:
        counts: dict[str, int] = {}
        for outcome in report.outcomes:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no workloads"
        log(f"round done in {report.seconds:.1f} s: {summary}")
        if as_json:
            click.echo(json.dumps(report.to_dict(), sort_keys=True), nl=True)

    stop = StopSignal()
    stop.install()
    with CacheClient(base_url=server, token=token) as client:
        run_agent(
            options,
            client=client,
            interval_s=interval_s,
            once=once,
            stop=stop,
            log=log,
            on_round=on_round,
        )
    if stop.is_set():
        log("agent stopped")
