"""``cachekeeper workload register FILE`` / ``ls`` / ``rm``: the server's registered workloads.

Agents build every registered workload; ``prejob --workload NAME`` and ``push`` check the
name against this list. ``register`` validates the file here first (the same checks the
server makes), then sends it under the name the file gives itself, so the name in the URL
and in the file cannot differ.
"""

from __future__ import annotations

from pathlib import Path

import click

from cachekeeper.builder.workload import load_workload
from cachekeeper.cli._common import (
    PathParam,
    emit_json,
    handle_errors,
    json_option,
    open_client,
    server_option,
    timeout_option,
    token_option,
)
from cachekeeper.wire import to_dict

__all__ = ["workload_cmd"]


@click.group("workload")
def workload_cmd() -> None:
    """Register, list and remove the server's workloads (what agents keep warm)."""


@workload_cmd.command("register")
@click.argument("file", type=PathParam(path_type=Path, dir_okay=False))
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def register_cmd(file: Path, server: str | None, token: str | None, as_json: bool) -> None:
    """Validate workload FILE and register it on the server under the name it gives itself.

    Registering a name again replaces its file. Needs the write scope for a workload
    without code, and the admin scope for one that holds code a builder runs (a
    [[command]], an [[entrypoint]], a mask or score_mod named pkg.mod:factory).
    """
    workload = load_workload(file)
    with open_client(server, token) as client:
        info = client.register_workload(workload.name, workload.text)
    if as_json:
        emit_json(to_dict(info))
        return
    click.echo(f"registered {info.name} (digest {info.digest[:12]}, {info.updated_at})")


@workload_cmd.command("ls")
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def ls_cmd(server: str | None, token: str | None, as_json: bool) -> None:
    """List the workloads registered on the server. Needs the read scope."""
    with open_client(server, token) as client:
        workloads = client.list_workloads()
    if as_json:
        emit_json({"workloads": [to_dict(w) for w in workloads]})
        return
    if not workloads:
        click.echo("no workloads registered")
        return
    click.echo(f"{'NAME':<32}{'DIGEST':<14}UPDATED")
    for w in workloads:
        click.echo(f"{w.name[:31]:<32}{w.digest[:12]:<14}{w.updated_at}")


@workload_cmd.command("rm")
@click.argument("name")
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def rm_cmd(name: str, server: str | None, token: str | None, as_json: bool) -> None:
    """Unregister workload NAME (its snapshots stay). Needs the admin scope."""
    with open_client(server, token) as client:
        client.delete_workload(name)
    if as_json:
        emit_json({"removed": name})
        return
    click.echo(f"removed workload {name}")
