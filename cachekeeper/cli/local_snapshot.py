"""The local snapshot commands: ``snapshot`` (create an archive), ``restore``, ``inspect``.

The server's snapshots (``cachekeeper snapshots ls/pin/unpin/rm``) are
``cli/server_snapshots.py``; the local store's ``ls``/``rm``/``gc`` are ``cli/local.py``.
Each parses, makes one library call, and prints (``--json`` for scripts). A snapshot is
named by an archive file path or by a local store id (or a unique id prefix).
Restore conflicts (a different file already at a snapshot path, kept as it was) are
reported, one warning line each, and do not change the exit code.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from cachekeeper.cli._common import (
    PathParam,
    echo_err,
    emit_json,
    handle_errors,
    json_option,
    mb,
    printable,
    server_option,
    timeout_option,
    token_option,
)
from cachekeeper.cli.keys import sign_key_option, trust_option, trusted_keys
from cachekeeper.environment import fingerprint as fingerprint_mod
from cachekeeper.errors import NoMatchingSnapshot, SnapshotNotFound
from cachekeeper.restore import RestoreReport, restore, restore_archive
from cachekeeper.restore.repair import plan_set_aside
from cachekeeper.snapshot.make import read_archive_manifest, snapshot_dir, write_archive
from cachekeeper.snapshot.manifest import Manifest
from cachekeeper.store import LocalStore

__all__ = ["snapshot_cmd", "restore_cmd", "inspect_cmd", "load_manifest", "archive_path"]

_ID_CHARS = re.compile(r"[0-9a-f]+")


def archive_path(ref: str) -> Path | None:
    """``ref`` as an archive file, or None when it names a store id.

    A ref that is no file and cannot be an id (not hex: ``missing.tar.zst``, ``dir/x``)
    is a file that is not there, and says so rather than "no snapshot in the store".
    """
    path = Path(ref)
    if path.is_file():
        return path
    if path.is_dir():
        raise SnapshotNotFound(f"{ref} is a directory, not a snapshot archive")
    if not _ID_CHARS.fullmatch(ref.lower()):
        raise SnapshotNotFound(f"file not found: {ref} (and it is not a snapshot id)")
    return None


def load_manifest(
    ref: str, *, server: str | None = None, token: str | None = None
) -> tuple[Manifest, str]:
    """The manifest named by an archive path, a local store id, or (with ``server``) an id
    or unique prefix of the server's; and where it came from (archive, store, server).

    The local store is asked first; a server id it does not hold goes to the server, so
    the id ``postjob``, ``status`` and ``snapshots ls`` print works as it is.
    """
    path = archive_path(ref)
    if path is not None:
        return read_archive_manifest(path), "archive"
    try:
        return LocalStore().load_manifest(ref), "store"
    except SnapshotNotFound as exc:
        if not server:
            raise SnapshotNotFound(
                f"{exc.detail} (a server snapshot: pass --server or set CACHEKEEPER_SERVER)"
            ) from exc
    # local import: httpx only when the snapshot is the server's
    from cachekeeper.cli._common import open_client
    from cachekeeper.cli.server_snapshots import resolve_server_id

    with open_client(server, token) as client:
        return client.get_manifest(resolve_server_id(client, ref)), "server"


@contextlib.contextmanager
def _progress(total_bytes: int, label: str) -> Iterator[Any]:
    """A rich progress bar on stderr when it is a terminal; else a no-op callback."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=total_bytes)
        yield lambda n: bar.advance(task, n)


@click.command("snapshot")
@click.argument("cache_dir", type=PathParam(path_type=Path, file_okay=False))
@click.option(
    "-o",
    "--output",
    type=PathParam(path_type=Path, dir_okay=False),
    help="Also write the one-file archive here (.tar.zst).",
)
@click.option("--workload", help="Workload name to record in the manifest.")
@sign_key_option
@json_option
@handle_errors
def snapshot_cmd(
    cache_dir: Path,
    output: Path | None,
    workload: str | None,
    sign_key: Path | None,
    as_json: bool,
) -> None:
    """Snapshot CACHE_DIR into the local store (and, with -o, into one archive file)."""
    store = LocalStore()
    try:
        manifest = snapshot_dir(cache_dir, store=store, workload=workload, sign_key=sign_key)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        archive_bytes = write_archive(manifest, store.blobs, output) if output else None
    except OSError as exc:  # name the archive asked for, not the temp file beside it
        raise OSError(exc.errno, exc.strerror or str(exc), str(output)) from exc
    result = {
        "id": manifest.id,
        "files": len(manifest.files),
        "size_bytes": manifest.size_bytes,
        "archive": str(output) if output else None,
        "archive_bytes": archive_bytes,
        "devices": list(manifest.devices),
        "signed_by": (manifest.signature or {}).get("key_id"),
    }
    if as_json:
        emit_json(result)
        return
    click.echo(f"snapshot {manifest.id}")
    click.echo(f"  {len(manifest.files)} files, {mb(manifest.size_bytes)}")
    if output:
        click.echo(f"  archive {output} ({mb(archive_bytes or 0)})")


@click.command("restore")
@click.argument("snapshot")
@click.option(
    "--cache-dir",
    required=True,
    type=PathParam(path_type=Path, file_okay=False),
    help="The cache dir to restore into (created if missing).",
)
@click.option("--dry-run", is_flag=True, help="List what would be written; write nothing.")
@click.option(
    "--repair",
    is_flag=True,
    help="Replace files whose bytes differ from the snapshot (corrupt entries), moving each"
    " to .cachekeeper/set-aside/<time>/ in the cache dir first; never deletes.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Restore a snapshot built for another environment (named on stderr) anyway.",
)
@trust_option
@json_option
@handle_errors
def restore_cmd(
    snapshot: str,
    cache_dir: Path,
    dry_run: bool,
    force: bool,
    repair: bool,
    trust: tuple[Path, ...],
    as_json: bool,
) -> None:
    """Restore SNAPSHOT (archive file or local store id) into a cache dir, safely.

    Nothing present is deleted or overwritten: identical files are skipped, different
    ones are kept and reported as conflicts (exit code stays 0). A snapshot built for
    another environment (torch, Triton, CUDA, Python, GPU model, ...: its entries would
    never hit here) is refused, naming the fields that differ, unless --force. With a trust list
    (--trust or CACHEKEEPER_TRUSTED_KEYS), only a snapshot signed by one of those keys
    is restored, and all of it or nothing. With --repair, files whose bytes differ from
    the snapshot (a corrupt entry) are first moved to .cachekeeper/set-aside/<time>/ in
    the cache dir, as they were, and the restore writes the snapshot's in their place.
    """
    trusted = trusted_keys(trust)
    path = archive_path(snapshot)
    manifest = read_archive_manifest(path) if path is not None else None
    store = LocalStore()
    if manifest is None:
        manifest = store.load_manifest(snapshot)
    _check_environment(manifest, force=force)

    def run(*, dry: bool) -> RestoreReport:
        with _progress(0 if dry else manifest.size_bytes, "restoring") as progress:
            if path is not None:
                return restore_archive(path, cache_dir, dry_run=dry, progress=progress,
                                       trusted_keys=trusted, manifest=manifest)  # fmt: skip
            return restore(manifest, store.blobs, cache_dir, dry_run=dry, progress=progress,
                           trusted_keys=trusted)  # fmt: skip

    aside = None
    if repair:  # the restore's own verdicts: which paths hold something else
        aside = plan_set_aside(cache_dir, run(dry=True).conflicts)
        if not dry_run:
            aside = replace(aside, paths=tuple(aside.execute()))
    report = run(dry=dry_run)
    if as_json:
        body = report.to_dict()
        if aside is not None:
            body["set_aside"] = list(aside.paths)
            body["set_aside_dir"] = str(aside.folder) if aside.paths else None
        emit_json(body)
    else:
        if aside is not None and aside.paths:
            verb = "would move" if dry_run else "moved"
            click.echo(
                f"repair: {verb} {len(aside.paths)} file(s) whose bytes differ from the"
                f" snapshot to {aside.folder}"
            )
        if dry_run:
            for rel in report.planned:
                click.echo(f"would write {rel}")
            click.echo(
                f"dry run: {len(report.planned)} to write, {report.skipped} present, "
                f"{len(report.conflicts)} conflicts"
            )
        else:
            shared = ""
            if report.shared:
                held = sorted({i[:12] for i in report.shared.values()})
                shared = (
                    f", {len(report.shared)} held as snapshot {', '.join(held)} restored them"
                    " (the same cache entries, built separately)"
                )
            click.echo(
                f"restored {report.snapshot_id[:12]} into {cache_dir}: {report.written} written "
                f"({mb(report.bytes_written)}), {report.skipped} already present, "
                f"{len(report.conflicts)} conflicts{shared}"
            )
    for rel in report.conflicts:
        if aside is not None and rel in aside.paths:
            continue  # a dry run: --repair would move it
        hint = "" if repair else "; --repair replaces it, keeping this one aside"
        echo_err(f"warning: kept existing {rel} (differs from the snapshot{hint})")


def environment_differences(manifest: Manifest) -> list[str]:
    """``field: this node X, snapshot Y`` for each field on which this node differs.

    The CPU thread count is left out: the shell that restores is not the job that runs
    (``explain`` and the hook check it, with the job's environment).
    """
    node = fingerprint_mod.collect()
    devices = list(manifest.devices)
    found = fingerprint_mod.compare(
        node, manifest.fingerprint, devices=devices, node_devices=devices
    )
    return [
        f"{m.field}: this node {_value(m.node)}, snapshot {_value(m.snapshot)}"
        for m in found
        if m.field not in ("devices", "cpu")
    ]


def _value(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return ", ".join(str(v.get("name")) for v in value) or "none"
    return "none" if value is None else str(value)


def _check_environment(manifest: Manifest, *, force: bool) -> None:
    differences = environment_differences(manifest)
    if not differences:
        return
    what = f"snapshot {manifest.id[:12]} was built for another environment: " + "; ".join(
        differences
    )
    if not force:
        raise NoMatchingSnapshot(
            f"{what}. Its entries would not hit here; restore it anyway with --force"
        )
    echo_err(f"warning: {what} (restoring anyway: --force)")


@click.command("inspect")
@click.argument("snapshot")
@click.option("--files", "show_files", is_flag=True, help="List every file.")
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def inspect_cmd(
    snapshot: str, show_files: bool, server: str | None, token: str | None, as_json: bool
) -> None:
    """Show a snapshot's manifest summary.

    SNAPSHOT is an archive file, a local store id, or a server's snapshot id or unique
    prefix (with --server or CACHEKEEPER_SERVER; read scope).
    """
    manifest, origin = load_manifest(snapshot, server=server, token=token)
    if as_json:
        body = manifest.to_dict()
        body["id"] = manifest.id
        if not show_files:
            body["file_count"] = len(body.pop("files"))
        emit_json(body)
        return
    fp = manifest.fingerprint
    for label, value in (
        ("id", manifest.id),
        ("source", origin),
        ("workload", manifest.workload or "-"),
        ("devices", ", ".join(manifest.devices) or "-"),
        ("files", f"{len(manifest.files)} ({mb(manifest.size_bytes)})"),
        ("blobs", len(manifest.digests)),
        ("verified", "yes" if manifest.verified else "no"),
        ("signed", "yes" if manifest.signature else "no"),
        ("torch", fp.get("torch")),
        ("triton", fp.get("triton")),
        ("driver", fp.get("driver")),
        ("fingerprint", manifest.fingerprint_digest),
    ):
        click.echo(f"{label:<12} {printable(value)}")  # a manifest's text, escaped
    if show_files:
        for entry in manifest.files:
            click.echo(f"{entry.mode:o} {entry.size_bytes:>12} {entry.digest[:12]} {entry.path}")
