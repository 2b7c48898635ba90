"""``cachekeeper keygen``, and the ``--sign-key`` / ``--trust`` options other commands share."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from cachekeeper import config
from cachekeeper.cli._common import PathParam, emit_json, handle_errors, json_option
from cachekeeper.snapshot.signing import generate_keypair, load_trusted_keys

if TYPE_CHECKING:
    from cachekeeper.snapshot.signing import TrustedKey

__all__ = ["keygen_cmd", "sign_key_option", "trust_option", "trust_paths", "trusted_keys"]

sign_key_option = click.option(
    "--sign-key",
    type=PathParam(exists=True, dir_okay=False, path_type=Path),
    metavar="PREFIX.key",
    help="Sign the manifest with this Ed25519 private key (from `cachekeeper keygen`).",
)
# No exists=True: a missing key file is a one-line error from the library (and, for
# prejob, a cold start rather than a failed job).
trust_option = click.option(
    "--trust",
    multiple=True,
    type=PathParam(dir_okay=False, path_type=Path),
    metavar="FILE.pub",
    help="Accept only snapshots signed by this public key (repeatable; default: "
    "$CACHEKEEPER_TRUSTED_KEYS, paths separated by ':'). Without any, nothing is checked.",
)


def trust_paths(trust: tuple[Path, ...]) -> list[str]:
    """The ``--trust`` files, else those CACHEKEEPER_TRUSTED_KEYS names (may be none)."""
    if trust:
        return [os.fspath(p) for p in trust]
    return config.trusted_key_paths(os.environ)


def trusted_keys(trust: tuple[Path, ...]) -> list[TrustedKey]:
    """The trusted public keys, loaded (a one-line error names an unreadable one)."""
    return load_trusted_keys(trust_paths(trust))


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
    key_path, pub_path, key_id = generate_keypair(prefix)
    if as_json:
        emit_json({"private_key": str(key_path), "public_key": str(pub_path), "key_id": key_id})
    else:
        click.echo(f"key id {key_id}\nprivate {key_path} (keep secret)\npublic  {pub_path}")
