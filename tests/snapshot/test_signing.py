"""Signatures: a signed manifest verifies; unsigned, untrusted and tampered ones are refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cachekeeper.environment.fingerprint import collect
from cachekeeper.errors import CachekeeperError, SignatureInvalid
from cachekeeper.snapshot.manifest import FileEntry, Manifest
from cachekeeper.snapshot.signing import (
    generate_keypair,
    load_public_key,
    public_key_of,
    sign_manifest,
    signature_problem,
    trusted_key_from_wire,
    trusted_keys_from_env,
    verify_manifest,
)


def _manifest() -> Manifest:
    return Manifest(
        files=(FileEntry(path="fxgraph/ab/x", digest="a" * 64, size_bytes=3),),
        fingerprint=collect(),
        devices=("cpu",),
        workload="w",
    )


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path, str]:
    return generate_keypair(tmp_path / "builder")


def test_keygen_writes_private_key_0600_and_refuses_overwrite(keys, tmp_path: Path) -> None:
    key_path, pub_path, key_id = keys
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    assert pub_path.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert len(key_id) == 16
    with pytest.raises(CachekeeperError, match="already exists"):
        generate_keypair(tmp_path / "builder")


def test_signed_manifest_verifies_and_keeps_its_id(keys) -> None:
    key_path, pub_path, key_id = keys
    manifest = _manifest()
    signed = sign_manifest(manifest, key_path)
    assert signed.id == manifest.id
    assert verify_manifest(signed, [load_public_key(pub_path)]) == key_id
    # The signature survives a JSON round trip (the form it travels in).
    assert verify_manifest(Manifest.from_json(signed.to_json()), [load_public_key(pub_path)])


def test_unsigned_untrusted_and_tampered_are_refused(keys, tmp_path: Path) -> None:
    key_path, pub_path, _ = keys
    trusted = [load_public_key(pub_path)]
    with pytest.raises(SignatureInvalid, match="unsigned"):
        verify_manifest(_manifest(), trusted)

    other_key, _, _ = generate_keypair(tmp_path / "mallory")
    with pytest.raises(SignatureInvalid, match="not trusted"):
        verify_manifest(sign_manifest(_manifest(), other_key), trusted)

    signed = sign_manifest(_manifest(), key_path).to_dict()
    signed["files"][0]["digest"] = "b" * 64  # one changed byte in the manifest
    with pytest.raises(SignatureInvalid, match="does not match"):
        verify_manifest(Manifest.from_dict(signed), trusted)


def test_trusted_keys_from_env(keys, tmp_path: Path) -> None:
    _, pub_path, key_id = keys
    _, pub2, key_id2 = generate_keypair(tmp_path / "second")
    env = {"CACHEKEEPER_TRUSTED_KEYS": f"{pub_path}{os.pathsep}{pub2}"}
    assert [k.key_id for k in trusted_keys_from_env(env)] == [key_id, key_id2]
    assert trusted_keys_from_env({}) == []


def test_verified_is_part_of_what_the_key_signs(keys) -> None:
    """Issue 32: a signed manifest whose verify statistics were changed (its verified claim
    flipped) no longer matches its signature; the format did not change for it."""
    key_path, pub_path, _ = keys
    trusted = [load_public_key(pub_path)]
    unverified = Manifest(
        files=_manifest().files,
        fingerprint=collect(),
        workload="w",
        stats={"verify": {"effective": False}},
    )
    signed = sign_manifest(unverified, key_path).to_dict()
    signed["stats"] = {"verify": {"effective": True}}
    forged = Manifest.from_dict(signed)
    assert forged.verified and forged.signature is not None
    assert signature_problem(forged, trusted) == (
        f"signature by key {trusted[0].key_id} does not match the manifest (tampered or corrupted)"
    )
    with pytest.raises(SignatureInvalid, match="does not match"):
        verify_manifest(forged, trusted)


def test_a_claimed_key_id_earns_nothing_without_the_keys_signature(keys, tmp_path: Path) -> None:
    key_path, pub_path, key_id = keys
    trusted = [load_public_key(pub_path)]
    other_key, _, _ = generate_keypair(tmp_path / "mallory")
    signed = sign_manifest(_manifest(), other_key)
    claimed = signed.with_signature({**(signed.signature or {}), "key_id": key_id})
    assert "does not match" in (signature_problem(claimed, trusted) or "")
    assert signature_problem(sign_manifest(_manifest(), key_path), trusted) is None
    assert signature_problem(_manifest(), trusted) == "unsigned"
    assert signature_problem(_manifest(), []) == "unsigned"


def test_a_public_key_travels_as_base64_and_comes_back_the_same(keys) -> None:
    key_path, pub_path, key_id = keys
    public = load_public_key(pub_path)
    assert public_key_of(key_path).raw == public.raw and public_key_of(key_path).key_id == key_id
    assert len(public.wire) == 44
    back = trusted_key_from_wire(public.wire)
    assert (back.key_id, back.raw) == (key_id, public.raw)
    for bad in ("not base64!", "AAAA"):
        with pytest.raises(ValueError, match="trusted key"):
            trusted_key_from_wire(bad)
