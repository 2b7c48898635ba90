"""Ed25519 signatures over snapshot manifests.

Cache entries are code: Inductor imports the ``.py`` files and loads the ``.so``/cubin files
it finds in the cache dir, so whoever can place a snapshot on a node runs code in every
training job there. A signature covers the manifest's canonical JSON (without the
signature itself, i.e. exactly the bytes whose sha256 is the snapshot id); since every
blob is verified against the manifest's digests before it is written, one signature
covers every byte of the snapshot.

Key files (``cachekeeper keygen --out PREFIX``)::

    PREFIX.key   PEM PKCS#8 private key, mode 0600
    PREFIX.pub   PEM SubjectPublicKeyInfo public key

A key's id is the first 16 hex digits of the sha256 of its raw 32-byte public key.
Trusted keys come from ``--trust FILE.pub`` (repeatable) or ``CACHEKEEPER_TRUSTED_KEYS``
(paths separated by ``os.pathsep``).
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachekeeper import config
from cachekeeper.errors import CachekeeperError, SignatureInvalid
from cachekeeper.manifest import Manifest

__all__ = [
    "ALGORITHM",
    "SigningKey",
    "TrustedKey",
    "generate_keypair",
    "load_signing_key",
    "sign_manifest",
    "verify_manifest",
    "load_public_key",
    "load_trusted_keys",
    "trusted_keys_from_env",
]

ALGORITHM = "ed25519"


@dataclass(frozen=True)
class TrustedKey:
    key_id: str
    raw: bytes  # the 32-byte Ed25519 public key
    source: str


def _key_id(raw_public: bytes) -> str:
    return hashlib.sha256(raw_public).hexdigest()[:16]


def _raw_public(public_key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(  # type: ignore[attr-defined,no-any-return]
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )


def generate_keypair(prefix: str | os.PathLike[str]) -> tuple[Path, Path, str]:
    """Write ``PREFIX.key`` (0600) and ``PREFIX.pub``; refuse to overwrite. Returns paths and id."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key_path, pub_path = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for path in (key_path, pub_path):
        if path.exists():
            raise CachekeeperError(f"{path} already exists; refusing to overwrite a key")
    private = Ed25519PrivateKey.generate()
    key_pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    pub_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    key_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key_pem)
    pub_path.write_bytes(pub_pem)
    return key_path, pub_path, _key_id(_raw_public(private.public_key()))


@dataclass(frozen=True)
class SigningKey:
    """A private key read once into memory, with the file it came from.

    The agent reads its key before it runs any build, and builds cannot read the file
    (``cachekeeper.landlock``). A ``SigningKey`` is a path-like naming that file, so it goes
    wherever a key path does (``push``, ``snapshot_dir``), and ``load_signing_key`` returns
    the key it holds instead of reading the file again.
    """

    private: Any = field(repr=False)
    key_id: str
    path: Path

    @classmethod
    def load(cls, key_path: str | os.PathLike[str]) -> SigningKey:
        private = load_signing_key(key_path)
        return cls(private, _key_id(_raw_public(private.public_key())), Path(key_path))

    def __fspath__(self) -> str:
        return str(self.path)


def load_signing_key(key_path: str | os.PathLike[str]) -> Any:
    """The Ed25519 private key at ``key_path`` (the one a ``SigningKey`` holds); one-line
    error when unreadable or wrong."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if isinstance(key_path, SigningKey):
        return key_path.private
    try:
        private = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise CachekeeperError(f"cannot read signing key {key_path}: {exc}") from exc
    if not isinstance(private, Ed25519PrivateKey):
        raise CachekeeperError(f"signing key {key_path} is not an Ed25519 private key")
    return private


def sign_manifest(manifest: Manifest, key_path: str | os.PathLike[str]) -> Manifest:
    """The same manifest (same id) with an Ed25519 signature by the key at ``key_path``."""
    private = load_signing_key(key_path)
    signature = private.sign(manifest.signing_bytes())
    return manifest.with_signature(
        {
            "algorithm": ALGORITHM,
            "key_id": _key_id(_raw_public(private.public_key())),
            "signature": base64.b64encode(signature).decode(),
        }
    )


# DER SubjectPublicKeyInfo of an Ed25519 key: this fixed 12-byte header, then the raw key.
_ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")


def load_public_key(path: str | os.PathLike[str]) -> TrustedKey:
    """Read a ``PREFIX.pub`` file (PEM SubjectPublicKeyInfo, Ed25519).

    Parsed with the standard library (an Ed25519 key's DER form is a fixed header plus the
    32 raw bytes), so the pre-job hook's no-op path can check key ids without importing
    ``cryptography`` (about 90 ms); the signature check itself imports it.
    """
    if not os.fspath(path).strip():
        raise CachekeeperError(
            f"a trusted key is named by an empty path ({config.TRUSTED_KEYS} is set but names"
            " no key file): no snapshot can be trusted; name the .pub files, or unset it"
        )
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise CachekeeperError(f"cannot read trusted key {path}: {exc}") from exc
    lines = [line.strip() for line in text.strip().splitlines()]
    if (
        len(lines) < 3
        or lines[0] != "-----BEGIN PUBLIC KEY-----"
        or lines[-1] != "-----END PUBLIC KEY-----"
    ):
        raise CachekeeperError(f"trusted key {path} is not a PEM public key")
    try:
        der = base64.b64decode("".join(lines[1:-1]), validate=True)
    except ValueError as exc:
        raise CachekeeperError(f"trusted key {path} is not a PEM public key: {exc}") from exc
    if len(der) != len(_ED25519_SPKI_PREFIX) + 32 or not der.startswith(_ED25519_SPKI_PREFIX):
        raise CachekeeperError(f"trusted key {path} is not an Ed25519 public key")
    raw = der[len(_ED25519_SPKI_PREFIX) :]
    return TrustedKey(key_id=_key_id(raw), raw=raw, source=str(path))


def load_trusted_keys(paths: Iterable[str | os.PathLike[str]]) -> list[TrustedKey]:
    return [load_public_key(p) for p in paths]


def trusted_keys_from_env(environ: Mapping[str, str] | None = None) -> list[TrustedKey]:
    return load_trusted_keys(config.trusted_key_paths(os.environ if environ is None else environ))


def verify_manifest(manifest: Manifest, trusted: Iterable[TrustedKey]) -> str:
    """Return the signing key's id, or raise ``SignatureInvalid`` saying why.

    Call only when a trust list is configured: with one, an unsigned manifest, a key not
    in the list, or a signature that does not match the manifest's bytes is refused.
    """
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    keys = {k.key_id: k for k in trusted}
    sig = manifest.signature
    snapshot = manifest.id[:12]
    if not sig:
        raise SignatureInvalid(f"snapshot {snapshot} is unsigned and a trust list is configured")
    if sig.get("algorithm") != ALGORITHM:
        raise SignatureInvalid(
            f"snapshot {snapshot} is signed with {sig.get('algorithm')!r}, not {ALGORITHM}"
        )
    key = keys.get(str(sig.get("key_id")))
    if key is None:
        raise SignatureInvalid(
            f"snapshot {snapshot} is signed by key {sig.get('key_id')!r}, which is not trusted"
        )
    try:
        signature = base64.b64decode(str(sig.get("signature", "")), validate=True)
        Ed25519PublicKey.from_public_bytes(key.raw).verify(signature, manifest.signing_bytes())
    except (InvalidSignature, ValueError) as exc:
        raise SignatureInvalid(
            f"snapshot {snapshot}: signature by key {key.key_id} does not match the manifest "
            "(tampered or corrupted)"
        ) from exc
    return key.key_id
