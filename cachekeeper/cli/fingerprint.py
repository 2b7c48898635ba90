"""Fingerprint commands: fingerprint (this node's environment) and explain (why a snapshot
does or does not suit this node, field by field)."""

from __future__ import annotations

import sys

import click

from cachekeeper.cli._common import emit_json, handle_errors, json_option
from cachekeeper.cli.snapshot import load_manifest

__all__ = ["fingerprint_cmd", "explain_cmd"]


@click.command("fingerprint")
@json_option
@handle_errors
def fingerprint_cmd(as_json: bool) -> None:
    """Print this machine's environment fingerprint and its digest."""
    from cachekeeper.fingerprint import collect, digest_of

    fp = collect()
    digest = digest_of(fp)
    if as_json:
        emit_json({"digest": digest, "fingerprint": fp})
        return
    gpus = ", ".join(
        f"{g.get('index')}: {g.get('name')} (sm {g.get('capability')})" for g in fp.get("gpus", [])
    )
    wheels = ", ".join(f"{k} {v}" for k, v in (fp.get("cuda_wheels") or {}).items())
    for label, value in (
        ("torch", fp.get("torch")),
        ("triton", fp.get("triton")),
        ("cuda", fp.get("cuda")),
        ("driver", fp.get("driver")),
        ("gpus", gpus or "none"),
        ("cuda wheels", wheels or "none"),
        ("python", fp.get("python")),
        ("arch", fp.get("arch")),
        ("env", ", ".join(f"{k}={v}" for k, v in (fp.get("env") or {}).items()) or "none"),
        ("digest", digest),
    ):
        click.echo(f"{label:<12} {value}")


@click.command("explain")
@click.argument("snapshot")
@click.option(
    "--driver-policy",
    type=click.Choice(["newer", "exact", "any"]),
    default="newer",
    show_default=True,
    help="How the node's NVIDIA driver must relate to the builder's.",
)
@json_option
@handle_errors
def explain_cmd(snapshot: str, driver_policy: str, as_json: bool) -> None:
    """Compare this node's fingerprint with a snapshot's, field by field.

    SNAPSHOT is an archive file or a local store id. Exits 0 when this node can use
    the snapshot, 1 when it cannot.
    """
    from cachekeeper.fingerprint import collect, compare

    manifest, _ = load_manifest(snapshot)
    node = collect()
    mismatches = compare(
        node,
        manifest.fingerprint,
        driver_policy=driver_policy,  # type: ignore[arg-type]
        devices=list(manifest.devices),
    )
    if as_json:
        emit_json(
            {
                "snapshot_id": manifest.id,
                "compatible": not mismatches,
                "mismatches": [m.to_dict() for m in mismatches],
            }
        )
    elif mismatches:
        click.echo(f"snapshot {manifest.id[:12]} does NOT suit this node:")
        for m in mismatches:
            click.echo(f"  {m.field:<12} node {m.node!r}  snapshot {m.snapshot!r}")
    else:
        click.echo(f"snapshot {manifest.id[:12]} suits this node (driver policy {driver_policy})")
    sys.exit(1 if mismatches else 0)
