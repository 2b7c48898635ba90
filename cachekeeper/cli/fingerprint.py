"""Fingerprint commands: fingerprint (this node's environment) and explain (why a snapshot
does or does not suit this node, field by field)."""

from __future__ import annotations

import sys

import click

from cachekeeper.cli._common import (
    device_option,
    emit_json,
    handle_errors,
    json_option,
    printable,
    server_option,
    timeout_option,
    token_option,
)
from cachekeeper.environment.devices import requested_devices
from cachekeeper.environment.fingerprint import (
    SCHEMA,
    CpuState,
    collect,
    compare,
    describe_mismatch,
    digest_of,
    unchecked,
)
from cachekeeper.errors import CachekeeperError

__all__ = ["fingerprint_cmd", "explain_cmd"]


@click.command("fingerprint")
@json_option
@handle_errors
def fingerprint_cmd(as_json: bool) -> None:
    """Print this machine's environment fingerprint and its digest."""
    fp = collect()
    digest = digest_of(fp)
    if as_json:
        emit_json({"digest": digest, "fingerprint": fp})
        return
    gpus = ", ".join(f"{g['index']}: {g['name']} (sm {g['capability']})" for g in fp["gpus"])
    wheels = ", ".join(f"{k} {v}" for k, v in fp["cuda_wheels"].items())
    for label, value in (
        ("torch", fp["torch"]),
        ("triton", fp["triton"]),
        ("cuda", fp["cuda"]),
        ("driver", fp["driver"]),
        ("gpus", gpus or "none"),
        ("cuda wheels", wheels or "none"),
        ("python", fp["python"]),
        ("arch", fp["arch"]),
        ("env", ", ".join(f"{k}={v}" for k, v in fp["env"].items()) or "none"),
        ("cpu", _cpu_line(fp.get("cpu"))),
        ("digest", digest),
    ):
        click.echo(f"{label:<12} {value}")


def _cpu_line(cpu: CpuState | None) -> str:
    if cpu is None:
        return "not recorded"
    isa = cpu["isa"] or "no vector ISA"
    cap = cpu["aten_cpu_capability"]
    return f"{cpu['threads']} threads ({cpu['threads_from']}), {isa}" + (
        f", ATEN_CPU_CAPABILITY={cap}" if cap else ""
    )


@click.command("explain")
@click.argument("snapshot")
@click.option(
    "--driver-policy",
    type=click.Choice(["newer", "exact", "any"]),
    default="newer",
    show_default=True,
    help="How the node's NVIDIA driver must relate to the builder's.",
)
@device_option
@server_option
@token_option
@timeout_option
@json_option
@handle_errors
def explain_cmd(
    snapshot: str,
    driver_policy: str,
    device: str | None,
    server: str | None,
    token: str | None,
    as_json: bool,
) -> None:
    """Compare this node's fingerprint with a snapshot's, field by field.

    SNAPSHOT is an archive file, a local store id, or a server's snapshot id or unique
    prefix (the one postjob and status print; with --server or CACHEKEEPER_SERVER). Exits
    0 when this node can use the snapshot, 1 when it cannot. The device index is in
    Inductor's key: the snapshot must cover every device the job's ranks compile on
    (--device, default every visible GPU; a job that gives each rank one visible GPU uses
    only cuda:0). When the fingerprints match and a job still compiles on top of the
    snapshot, the difference is in the calls (shapes, dtypes, mask/score code, compile
    options), which no fingerprint holds: it says so.
    """
    try:
        node_devices = requested_devices(device)
    except CachekeeperError as exc:
        raise click.BadParameter(exc.detail, param_hint="--device") from exc
    # Here, not at the top: the snapshot reader (archive, zstandard, the client) is about
    # 50 ms of imports that plain `cachekeeper fingerprint` does not need.
    from cachekeeper.cli.local_snapshot import load_manifest

    manifest, _ = load_manifest(snapshot, server=server, token=token)
    node = collect()
    mismatches = compare(
        node,
        manifest.fingerprint,
        driver_policy=driver_policy,  # type: ignore[arg-type]
        devices=list(manifest.devices),
        node_devices=node_devices,
        built_by=manifest.built_by,
    )
    notes = [
        f"{field}: the snapshot's fingerprint does not record it (made before fingerprint "
        f"schema {SCHEMA}), so it was not checked"
        if manifest.fingerprint.get(field) is None
        else f"{field}: this node's fingerprint does not record it, so it was not checked"
        for field in unchecked(node, manifest.fingerprint, devices=list(manifest.devices))
    ]
    advice = None if mismatches else _calls_advice(manifest.workload)
    if as_json:
        emit_json(
            {
                "snapshot_id": manifest.id,
                "compatible": not mismatches,
                "mismatches": [{**m.to_dict(), "reason": describe_mismatch(m)} for m in mismatches],
                "unchecked": notes,
                "advice": advice,
            }
        )
    elif mismatches:
        click.echo(f"snapshot {manifest.id[:12]} does NOT suit this node:")
        for m in mismatches:
            if m.field in ("devices", "cpu"):
                click.echo(
                    f"  {m.field:<12} {printable(describe_mismatch(m).removeprefix('cpu: '))}"
                )
            else:
                click.echo(f"  {m.field:<12} node {m.node!r}  snapshot {m.snapshot!r}")
    else:
        click.echo(
            f"snapshot {manifest.id[:12]} suits this node: the fingerprints match"
            f" (driver policy {driver_policy})"
        )
        click.echo(f"  {advice}")
    for note in notes:
        click.echo(f"  note: {note}")
    sys.exit(1 if mismatches else 0)


def _calls_advice(workload: str | None) -> str:
    """What a match means for a job that compiled anyway: the calls differ."""
    what = f"the workload file of {workload!r}" if workload else "the workload file"
    return (
        "If a job here still compiles on top of it (postjob says so), the difference is in"
        " the calls, which no fingerprint holds: the shapes, dtypes, mask/score code,"
        f" compile options or device indices training uses that {what} does not list"
        " (docs/workloads.md)"
    )
