"""``cachekeeper cache ls`` / ``cache prune``: the hook's per-fingerprint cache dirs on a node.

A thin adapter over ``cachekeeper.restore.node_cache`` (scan, plan, execute): ``prune`` shows its
plan with the bytes it frees, asks unless ``--yes``, and ``--dry-run`` deletes nothing.
"""

from __future__ import annotations

import re

import click

from cachekeeper.cli._common import emit_json, handle_errors, json_option, mb
from cachekeeper.restore.node_cache import plan_prune, scan_node_dirs

__all__ = ["cache_cmd"]

_AGE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNIT_S = {"": 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}


def _age(ctx: click.Context, param: click.Parameter, value: str) -> float:
    found = _AGE.match(value.strip().lower())
    if found is None:
        raise click.BadParameter(f"{value!r} is not an age: give days, or 12h, 30m, 7d")
    return float(found.group(1)) * _UNIT_S[found.group(2)]


@click.group("cache")
def cache_cmd() -> None:
    """See and prune this node's per-environment cache dirs ($CACHEKEEPER_HOME/inductor)."""


@cache_cmd.command("ls")
@json_option
@handle_errors
def ls_cmd(as_json: bool) -> None:
    """List the hook's cache dirs: size, last use, fingerprint, snapshot, and whether this
    node's environment (at any thread count from 1 to its CPUs) uses it. Most recently
    used first."""
    rows = scan_node_dirs()
    if as_json:
        emit_json({"dirs": [r.to_dict() for r in rows]})
        return
    if not rows:
        click.echo("no cache dirs under $CACHEKEEPER_HOME/inductor")
        return
    click.echo(f"{'FINGERPRINT':<18}{'SIZE':>10}{'FILES':>7}  {'LAST USE':<17}{'SNAPSHOT':<14}NODE")
    for r in rows:
        used = f"{r.last_used_at:%Y-%m-%d %H:%M}" if r.last_used_at else "-"
        node = "this node" if r.matches_node else "other"
        if r.in_use:
            node += " (in use)"
        click.echo(
            f"{r.fingerprint:<18}{mb(r.size_bytes):>10}{r.file_count:>7}  {used:<17}"
            f"{(r.snapshot_id or '-')[:12]:<14}{node}"
        )


@cache_cmd.command("prune")
@click.argument("fingerprints", nargs=-1)
@click.option(
    "--older-than",
    "older_than_s",
    default="7d",
    show_default=True,
    callback=_age,
    help="Without FINGERPRINTS: prune the dirs unused for this long (7d, 12h, 30m; days).",
)
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@handle_errors
def prune_cmd(
    fingerprints: tuple[str, ...], older_than_s: float, dry_run: bool, yes: bool, as_json: bool
) -> None:
    """Delete cache dirs of other environments that no job uses.

    Without FINGERPRINTS (prefixes, or paths, as `cache ls` shows them): every dir unused
    for --older-than. Never this node's environment's dir, at any thread count from 1 to
    its CPUs however the count was set (OMP_NUM_THREADS, MKL_NUM_THREADS, taskset), and
    never a dir in use (a process has it as TORCHINDUCTOR_CACHE_DIR or a file open in it,
    or a restore holds its lock; checked again just before each deletion). A dir of this
    environment made before cachekeeper's fingerprint left provenance out (issue 31) is
    named by the older digest: another environment's here, pruned once unused.
    """
    plan = plan_prune(scan_node_dirs(), older_than_s=older_than_s, names=fingerprints)
    if plan.dirs and not dry_run and not yes and not as_json:
        click.confirm(
            f"Delete {len(plan.dirs)} cache dir(s) ({mb(plan.bytes_freed)})?", abort=True, err=True
        )
    gone = plan.dirs if dry_run else tuple(plan.execute())
    if as_json:
        body = {**plan.to_dict(), "dry_run": dry_run}
        body["dirs_removed"] = [str(d.path) for d in gone]
        body["bytes_freed"] = sum(d.size_bytes for d in gone)
        emit_json(body)
        return
    verb = "would delete" if dry_run else "deleted"
    for d in gone:
        click.echo(f"{verb} {d.path} ({mb(d.size_bytes)})")
    for d, why in plan.kept:
        click.echo(f"kept {d.path}: {why}")
    freed = sum(d.size_bytes for d in gone)
    click.echo(
        f"prune: {verb} {len(gone)} dir(s), {'would free' if dry_run else 'freed'} {mb(freed)}"
    )
