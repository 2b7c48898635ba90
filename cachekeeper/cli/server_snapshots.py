"""``cachekeeper snapshots ls`` / ``pin`` / ``unpin`` / ``rm`` / ``gc``: the server's snapshots.

The local store has its own ``local ls`` / ``rm`` / ``gc`` (``cli/local.py``), and the local snapshot
commands are ``cli/local_snapshot.py``; these talk to the server (--server/--token).
A snapshot is named by its id or a unique prefix of at least 4 characters, resolved
against the server's list.
"""

from __future__ import annotations

import click

from cachekeeper.cli._common import (
    emit_json,
    handle_errors,
    json_option,
    mb,
    open_client,
    printable,
    server_option,
    timeout_option,
    token_option,
)
from cachekeeper.client.api import CacheClient
from cachekeeper.errors import SnapshotNotFound
from cachekeeper.integrity import is_digest
from cachekeeper.wire import GcAnswer, Summary, to_dict

__all__ = ["snapshots_cmd", "resolve_server_id", "server_gc", "grace_line"]

_MIN_PREFIX = 4


def resolve_server_id(client: CacheClient, ref: str) -> str:
    """The full id on the server for an id or a unique prefix of at least 4 characters."""
    ref = ref.strip().lower()
    if is_digest(ref):
        return ref
    if len(ref) < _MIN_PREFIX:
        raise SnapshotNotFound(f"snapshot id prefix {ref!r} is too short (at least 4 characters)")
    matches = [s.id for s in client.list_snapshots() if s.id.startswith(ref)]
    if not matches:
        raise SnapshotNotFound(f"no snapshot {ref!r} on the server {client.base_url}")
    if len(matches) > 1:
        raise SnapshotNotFound(f"snapshot id prefix {ref!r} is ambiguous ({len(matches)} match)")
    return matches[0]


def _row(s: Summary) -> str:
    flags = ",".join(f for f, on in (("pinned", s.pinned), ("signed", s.signed)) if on) or "-"
    workload, devices = printable(s.workload or "-"), printable(",".join(s.devices))
    return (  # text from manifests: escaped (a workload name could be an escape sequence)
        f"{s.id[:12]:<14}{workload[:19]:<20}{printable(s.fingerprint_digest[:12]):<14}"
        f"{devices[:15]:<16}{s.file_count:>7}{mb(s.size_bytes):>12}  "
        f"{'yes' if s.verified else 'no':<9}{flags:<14}{printable(s.created_at[:16])}"
    )


_HEADER = (
    f"{'ID':<14}{'WORKLOAD':<20}{'ENVIRONMENT':<14}{'DEVICES':<16}{'FILES':>7}{'SIZE':>12}  "
    f"{'VERIFIED':<9}{'FLAGS':<14}CREATED"
)


@click.group("snapshots")
def snapshots_cmd() -> None:
    """List, pin, unpin and remove the server's snapshots, and run the server's GC."""


@snapshots_cmd.command("ls")
@click.option("--workload", metavar="NAME", help="Only this workload's snapshots.")
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def ls_cmd(workload: str | None, server: str | None, token: str | None, as_json: bool) -> None:
    """List the server's snapshots, newest first. Needs the read scope.

    ENVIRONMENT is the fingerprint digest's first 12 characters (as in `cachekeeper status`).
    """
    with open_client(server, token) as client:
        rows = client.list_snapshots(workload=workload)
    if as_json:
        emit_json({"snapshots": [to_dict(s) for s in rows]})
        return
    if not rows:
        click.echo("no snapshots on the server" + (f" for {workload}" if workload else ""))
        return
    click.echo(_HEADER)
    for s in rows:
        click.echo(_row(s))


def _set_pinned(ref: str, server: str | None, token: str | None, *, pinned: bool) -> Summary:
    with open_client(server, token) as client:
        return client.set_pinned(resolve_server_id(client, ref), pinned=pinned)


@snapshots_cmd.command("pin")
@click.argument("snapshot_id")
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def pin_cmd(snapshot_id: str, server: str | None, token: str | None, as_json: bool) -> None:
    """Keep SNAPSHOT_ID (or a unique prefix) out of LRU eviction. Needs the write scope."""
    summary = _set_pinned(snapshot_id, server, token, pinned=True)
    if as_json:
        emit_json(to_dict(summary))
        return
    click.echo(f"pinned {summary.id}")


@snapshots_cmd.command("unpin")
@click.argument("snapshot_id")
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def unpin_cmd(snapshot_id: str, server: str | None, token: str | None, as_json: bool) -> None:
    """Let LRU eviction take SNAPSHOT_ID (or a unique prefix) again. Needs the write scope."""
    summary = _set_pinned(snapshot_id, server, token, pinned=False)
    if as_json:
        emit_json(to_dict(summary))
        return
    click.echo(f"unpinned {summary.id}")


@snapshots_cmd.command("rm")
@click.argument("snapshot_ids", nargs=-1, required=True)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def rm_cmd(
    snapshot_ids: tuple[str, ...], yes: bool, server: str | None, token: str | None, as_json: bool
) -> None:
    """Remove snapshots (ids or unique prefixes) from the server. Needs the admin scope.

    Their blobs that no other snapshot uses are freed by a server GC (`snapshots gc`) once
    they have been unused for the server's grace period (gc_grace_s, 1 h by default);
    `snapshots gc --dry-run` says what it would free now and when the rest goes.
    """
    with open_client(server, token) as client:
        ids = [resolve_server_id(client, ref) for ref in snapshot_ids]
        if not yes:
            click.confirm(
                f"Delete {len(ids)} snapshots from {client.base_url}?", abort=True, err=True
            )
        for snapshot_id in ids:
            client.delete_snapshot(snapshot_id)
    if as_json:
        emit_json({"snapshots_removed": ids})
        return
    for snapshot_id in ids:
        click.echo(f"removed {snapshot_id}")
    click.echo(
        "their blobs no other snapshot uses are freed by a `snapshots gc` once unused for the"
        " server's grace period (1 h by default; `snapshots gc --dry-run` says when)"
    )


@snapshots_cmd.command("gc")
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing.")
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def gc_cmd(dry_run: bool, server: str | None, token: str | None, as_json: bool) -> None:
    """Run the server's GC. Needs the admin scope.

    Evict least recently used unpinned snapshots down to the store cap, then delete blobs
    no snapshot references and nothing used within the server's grace period (gc_grace_s,
    1 h by default: an upload waiting for its publish, the blobs of a snapshot just
    removed). It says what it keeps and when a later GC frees it, --dry-run too. --json
    keys are those of POST /v1/gc. The local store's GC is `cachekeeper local gc`.
    """
    server_gc(server, token, dry_run=dry_run, as_json=as_json)


def server_gc(server: str | None, token: str | None, *, dry_run: bool, as_json: bool) -> None:
    """The server's GC and its report: ``cachekeeper snapshots gc`` (and the old ``gc --server``)."""
    with open_client(server, token) as client:
        answer = client.gc(dry_run=dry_run)
        where = client.base_url
    if as_json:
        emit_json(to_dict(answer))
        return
    verb = "would free" if dry_run else "freed"
    click.echo(
        f"server gc ({where}): {len(answer.snapshots_evicted)} snapshots evicted, "
        f"{answer.blobs_deleted} blobs; {verb} {mb(answer.bytes_freed)}"
    )
    if answer.blobs_in_grace:
        click.echo(f"  {grace_line(answer)}")


def grace_line(answer: GcAnswer) -> str:
    """What a server GC keeps for now, and when a later one frees it."""
    grace = f"{answer.grace_s / 3600:g} h" if answer.grace_s else "grace"
    when = (answer.grace_ends_at or "?")[:19].replace("T", " ")
    return (
        f"kept: {answer.blobs_in_grace} unreferenced blobs ({mb(answer.bytes_in_grace)}) used"
        f" within the last {grace} (the grace period, for uploads waiting to publish and"
        f" snapshots just removed); a gc after {when} UTC frees them, unless a snapshot"
        " references them again"
    )
