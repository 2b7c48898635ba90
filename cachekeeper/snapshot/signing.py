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
(paths separated by ``os.pathsep``). On the wire (resolve's ``trusted_keys``) a public key
is its 32 raw bytes in base64 (``TrustedKey.wire``): the server checks signatures against
the keys a node sends, never against a key id a manifest claims (``signature_problem``).

What a signature vouches for: every field of the manifest but the signature itself, the
verify statistics (``stats``, so ``verified``) and ``source`` included. A builder signs
only what it compiled itself in that round (``cachekeeper.builder.harvest``); ``snapshot_dir``
refuses to sign a dir holding bytes a restore put there.
"""

from __future__ import annotations

import base64
import hashlib
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachekeeper import config
from cachekeeper.errors import CachekeeperError, SignatureInvalid
from cachekeeper.fsutil import atomic_write_bytes
from cachekeeper.snapshot.manifest import Manifest

__all__ = [
    "ALGORITHM",
    "SigningKey",
    "TrustedKey",
    "generate_keypair",
    "load_signing_key",
    "public_key_of",
    "sign_manifest",
    "signature_problem",
    "signature_problem_of",
    "verify_manifest",
    "load_public_key",
    "load_trusted_keys",
    "trusted_key_from_wire",
    "trusted_keys_from_env",
]

ALGORITHM = "ed25519"


@dataclass(frozen=True)
class TrustedKey:
    key_id: str
    raw: bytes  # the 32-byte Ed25519 public key
    source: str

    @property
    def wire(self) -> str:
        """The key as resolve's ``trusted_keys`` carries it: base64 of the raw 32 bytes."""
        return base64.b64encode(self.raw).decode("ascii")


def trusted_key_from_wire(text: str) -> TrustedKey:
    """A key a node sent (``TrustedKey.wire``); ValueError when it is not 32 bytes."""
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise ValueError(f"trusted key {text[:60]!r} is not base64") from exc
    if len(raw) != 32:
        raise ValueError(f"trusted key {text[:60]!r} is not 32 bytes (an Ed25519 public key)")
    return TrustedKey(key_id=_key_id(raw), raw=raw, source="resolve request")


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
    # The private key appears whole or not at all, 0600 from its creation, and never over
    # an existing file: a 0600 temp file (fsutil's rule), then a hard link to its name
    # (which fails if the name exists, a link included), then the temp name goes.
    tmp = key_path.with_name(f".{key_path.name}.{uuid.uuid4().hex}.tmp")
    atomic_write_bytes(tmp, key_pem, mode=0o600)
    try:
        os.link(tmp, key_path, follow_symlinks=False)
    except FileExistsError as exc:
        raise CachekeeperError(f"{key_path} already exists; refusing to overwrite a key") from exc
    finally:
        tmp.unlink(missing_ok=True)
    pub_path.write_bytes(pub_pem)
    return key_path, pub_path, _key_id(_raw_public(private.public_key()))


@dataclass(frozen=True)
class SigningKey:
    """A private key read once into memory, with the file it came from.

    The agent reads its key before it runs any build, and builds cannot read the file
    (``cachekeeper.builder.landlock``). A ``SigningKey`` is a path-like naming that file, so it goes
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


def public_key_of(key_path: str | os.PathLike[str]) -> TrustedKey:
    """The public half of the signing key at ``key_path``: what a signing agent trusts."""
    raw = _raw_public(load_signing_key(key_path).public_key())
    return TrustedKey(key_id=_key_id(raw), raw=raw, source=str(key_path))


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


def signature_problem(manifest: Manifest, trusted: Iterable[TrustedKey]) -> str | None:
    """Why ``manifest`` is not validly signed by one of ``trusted`` (a short phrase), or None.

    The manifest's ``key_id`` only picks which trusted key to try: the signature is checked
    against that key's bytes over ``manifest.signing_bytes()``, so a claimed id with a
    signature the key did not make is "does not match", never trusted.
    """
    return signature_problem_of(manifest.signature, manifest.signing_bytes, trusted)


def signature_problem_of(
    signature: Any, signed_bytes: Callable[[], bytes], trusted: Iterable[TrustedKey]
) -> str | None:
    """``signature_problem`` for a signature block and the bytes it must cover, made only
    when a trusted key is named (the server's resolve checks stored manifests this way,
    without building a ``Manifest``)."""
    keys = {k.key_id: k for k in trusted}
    if not signature or not isinstance(signature, dict):
        return "unsigned"
    if signature.get("algorithm") != ALGORITHM:
        return f"signed with {str(signature.get('algorithm'))[:40]!r}, not {ALGORITHM}"
    key = keys.get(str(signature.get("key_id")))
    if key is None:
        return f"signed by key {str(signature.get('key_id'))[:40]!r}, which is not trusted"
    # Here, not at the top: the hook's no-op path reads key ids without cryptography (~90 ms).
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        raw = base64.b64decode(str(signature.get("signature", "")), validate=True)
        Ed25519PublicKey.from_public_bytes(key.raw).verify(raw, signed_bytes())
    except (InvalidSignature, ValueError):
        return f"signature by key {key.key_id} does not match the manifest (tampered or corrupted)"
    return None


def verify_manifest(manifest: Manifest, trusted: Iterable[TrustedKey]) -> str:
    """Return the signing key's id, or raise ``SignatureInvalid`` saying why.

    Call only when a trust list is configured: with one, an unsigned manifest, a key not
    in the list, or a signature that does not match the manifest's bytes is refused.
    """
    problem = signature_problem(manifest, trusted)
    snapshot = manifest.id[:12]
    if problem == "unsigned":
        raise SignatureInvalid(f"snapshot {snapshot} is unsigned and a trust list is configured")
    if problem is not None:
        raise SignatureInvalid(f"snapshot {snapshot}: {problem}")
    return str((manifest.signature or {}).get("key_id"))
