"""The local store's commands: ``cachekeeper local ls | rm | gc`` (a noun, then a verb).

Until issue 33 they were the top-level ``ls``, ``rm`` and ``gc`` (``gc --server`` ran the
server's GC, now ``cachekeeper snapshots gc``); those spellings stay for one release as
aliases (``cachekeeper.cli.ALIASES``): ``gc_cmd`` is the old ``gc``, with its ``--server``.

``rm`` and ``gc`` plan first (what would go, and the bytes it frees) and only then execute,
so ``--dry-run`` shows exactly what a real run deletes.
"""

from __future__ import annotations

import os
from typing import Any

import click

from cachekeeper import config
from cachekeeper.cli._common import (
    ca_bundle_option,
    emit_json,
    handle_errors,
    json_option,
    mb,
    printable,
    timeout_option,
    token_option,
)
from cachekeeper.cli.server_snapshots import server_gc
from cachekeeper.client.api import server_root
from cachekeeper.store import LocalStore

__all__ = ["local_cmd", "ls_cmd", "rm_cmd", "gc_cmd", "local_gc_cmd"]


_DRY_RUN = click.option(
    "--dry-run", is_flag=True, help="Show what would be deleted; delete nothing."
)


@click.group("local")
def local_cmd() -> None:
    """List, remove and garbage-collect the snapshots in this machine's local store.

    The local store ($CACHEKEEPER_HOME: snapshots/, blobs/) holds what `snapshot` and `prewarm` made
    here; the server's snapshots are `cachekeeper snapshots`.
    """


@click.command("ls")
@json_option
@handle_errors
def ls_cmd(as_json: bool) -> None:
    """List snapshots in the local store, newest first.

    Each with whether a prewarm verified it and the environment it was built for (torch,
    the CUDA torch was built with, the GPU model; '-' for none).
    """
    rows = LocalStore().list()
    if as_json:  # the shape and keys of `snapshots ls --json`
        emit_json({"snapshots": [r.to_dict() for r in rows]})
        return
    if not rows:
        click.echo("no snapshots in the local store")
        return
    click.echo(
        f"{'ID':<14}{'WORKLOAD':<20}{'DEVICES':<16}{'FILES':>7}{'SIZE':>12}  VERIFIED  "
        f"{'TORCH':<18}{'CUDA':<7}{'GPU':<20}CREATED"
    )
    for r in rows:
        click.echo(
            f"{r.id[:12]:<14}{printable(r.workload or '-')[:19]:<20}"
            f"{printable(','.join(r.devices))[:15]:<16}"
            f"{r.file_count:>7}{mb(r.size_bytes):>12}  {'yes' if r.verified else 'no':<8}  "
            f"{printable(r.torch or '-')[:17]:<18}{printable(r.cuda or '-')[:6]:<7}"
            f"{printable(r.gpu or '-')[:19]:<20}"
            f"{r.created_at:%Y-%m-%d %H:%M}"
        )


def _run_plan(plan: Any, *, dry_run: bool, as_json: bool, what: str) -> None:
    """Execute (unless ``dry_run``) a local plan and print it in the gc/rm vocabulary."""
    freed = plan.freed_bytes if dry_run else plan.execute()
    key = "snapshots_removed" if what == "rm" else "snapshots_evicted"
    body: dict[str, Any] = {
        key: list(plan.snapshot_ids),
        "blobs_deleted": len(plan.blob_digests),
        "bytes_freed": freed,
        "dry_run": dry_run,
    }
    if what == "gc":  # the local store keeps no grace period: every unreferenced blob goes
        body.update(blobs_in_grace=0, bytes_in_grace=0, grace_ends_at=None, grace_s=None)
    if as_json:
        emit_json(body)
        return
    verb = "would free" if dry_run else "freed"
    click.echo(
        f"{what}: {len(plan.snapshot_ids)} snapshots, {len(plan.blob_digests)} blobs; "
        f"{verb} {mb(freed)}"
    )


@click.command("rm")
@click.argument("ids", nargs=-1, required=True)
@_DRY_RUN
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@handle_errors
def rm_cmd(ids: tuple[str, ...], dry_run: bool, yes: bool, as_json: bool) -> None:
    """Remove snapshots (ids or unique prefixes) and the blobs only they use."""
    plan = LocalStore().plan_remove(list(ids))
    if not dry_run and not yes:
        click.confirm(
            f"Delete {len(plan.snapshot_ids)} snapshots and {len(plan.blob_digests)} blobs "
            f"({mb(plan.freed_bytes)})?",
            abort=True,
            err=True,
        )
    _run_plan(plan, dry_run=dry_run, as_json=as_json, what="rm")


@click.command("gc")
@_DRY_RUN
@json_option
@handle_errors
def local_gc_cmd(dry_run: bool, as_json: bool) -> None:
    """Delete local blobs that no stored snapshot references.

    The server's GC is `cachekeeper snapshots gc`. --json keys are those of POST /v1/gc.
    """
    _run_plan(LocalStore().plan_gc(), dry_run=dry_run, as_json=as_json, what="gc")


@click.command("gc")
@_DRY_RUN
@click.option(
    "--server",
    "server",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[URL]",
    help="Run the server's GC instead of the local store's (URL default: $CACHEKEEPER_SERVER).",
)
@ca_bundle_option
@token_option
@timeout_option
@json_option
@handle_errors
def gc_cmd(dry_run: bool, server: str | None, token: str | None, as_json: bool) -> None:
    """Delete local blobs that no stored snapshot references.

    With --server: the server's GC instead (admin scope): evict least recently used unpinned
    snapshots down to the store cap, then delete blobs no snapshot references and nothing
    used within the server's grace period (gc_grace_s, 1 h by default: an upload waiting
    for its publish, the blobs of a snapshot just removed). It says what it keeps and when
    a later GC frees it, --dry-run too. --json keys are those of POST /v1/gc, for both.
    """
    if server is None:
        _run_plan(LocalStore().plan_gc(), dry_run=dry_run, as_json=as_json, what="gc")
        return
    raw = server if server.strip() else os.environ.get(config.SERVER, "")
    server_gc(server_root(raw) if raw.strip() else None, token, dry_run=dry_run, as_json=as_json)


local_cmd.add_command(ls_cmd)
local_cmd.add_command(rm_cmd)
local_cmd.add_command(local_gc_cmd)
