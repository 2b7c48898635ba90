"""``cachekeeper keygen``: create a signing key pair."""

from __future__ import annotations

import click

from cachekeeper.cli._common import emit_json, handle_errors, json_option


@click.command("keygen")
@click.option(
    "--out",
    "prefix",
    required=True,
    metavar="PREFIX",
    help="Write PREFIX.key (private, mode 0600) and PREFIX.pub (public).",
)
@json_option
@handle_errors
def keygen_cmd(prefix: str, as_json: bool) -> None:
    """Create an Ed25519 key pair for signing snapshots.

    Sign with `snapshot/push/agent --sign-key PREFIX.key`; nodes trust the public key with
    `--trust PREFIX.pub` or CACHEKEEPER_TRUSTED_KEYS. Existing files are never overwritten.
    """
    from cachekeeper.signing import generate_keypair

    key_path, pub_path, key_id = generate_keypair(prefix)
    if as_json:
        emit_json({"private_key": str(key_path), "public_key": str(pub_path), "key_id": key_id})
    else:
        click.echo(f"key id {key_id}\nprivate {key_path} (keep secret)\npublic  {pub_path}")
