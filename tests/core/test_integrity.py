"""cachekeeper.integrity: the digest pattern, and bytes checked against a digest."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from cachekeeper.server.s3store import S3BlobStore, S3Location

from cachekeeper.blobstore import LocalBlobStore
from cachekeeper.errors import DigestMismatch, InvalidDigest, InvalidRequest
from cachekeeper.integrity import is_digest, require_digest

GOOD = hashlib.sha256(b"x").hexdigest()
MALFORMED = ["", "abc", GOOD.upper(), GOOD[:-1], GOOD + "0", f"../{GOOD[3:]}", GOOD[:-1] + "g"]


@pytest.mark.parametrize("bad", MALFORMED)
def test_a_malformed_digest_is_its_own_error_not_a_mismatch(bad: str, tmp_path: Path) -> None:
    """A name that is not a sha256 is a bad request (InvalidDigest, 422 invalid_digest),
    raised before anything is looked up: never DigestMismatch, which means bytes that hash
    to another digest (a client retries that one; a malformed name it must fix)."""
    assert not is_digest(bad)
    local = LocalBlobStore(tmp_path / "blobs")
    s3 = S3BlobStore(S3Location("bucket", "p/"), client=object())  # keys only: no request
    for refuse in (
        require_digest,
        local.path_for,
        local.stat,
        local.delete,
        s3.key_for,
        s3.archive_key,
    ):
        with pytest.raises(InvalidDigest) as raised:
            refuse(bad)
        assert not isinstance(raised.value, DigestMismatch)
        assert isinstance(raised.value, InvalidRequest) and raised.value.http_status == 422
        assert repr(bad) in str(raised.value)
    with pytest.raises(InvalidDigest):
        local.put([b"x"], digest=bad)
    assert not (tmp_path / "blobs").exists() or not any((tmp_path / "blobs").rglob("*.zst"))


def test_a_digest_passes_unchanged() -> None:
    assert require_digest(GOOD) == GOOD and is_digest(GOOD)
    assert not is_digest(None) and not is_digest(123)
