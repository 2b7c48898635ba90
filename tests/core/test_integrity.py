"""cachekeeper.integrity: the digest pattern, and bytes checked against a digest."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachekeeper.backends.local import LocalBackend
from cachekeeper.backends.s3 import S3Backend, S3Location
from cachekeeper.errors import BlobTooLarge, DigestMismatch, InvalidDigest, InvalidRequest
from cachekeeper.integrity import (
    BlobCheck,
    HashingReader,
    copy_verified,
    digest_of,
    hash_file,
    is_digest,
    require_digest,
    verify_bytes,
)

GOOD = hashlib.sha256(b"x").hexdigest()
MALFORMED = ["", "abc", GOOD.upper(), GOOD[:-1], GOOD + "0", f"../{GOOD[3:]}", GOOD[:-1] + "g"]


@pytest.mark.parametrize("bad", MALFORMED)
def test_a_malformed_digest_is_its_own_error_not_a_mismatch(bad: str, tmp_path: Path) -> None:
    """A name that is not a sha256 is a bad request (InvalidDigest, 422 invalid_digest),
    raised before anything is looked up: never DigestMismatch, which means bytes that hash
    to another digest (a client retries that one; a malformed name it must fix)."""
    assert not is_digest(bad)
    local = LocalBackend(tmp_path / "blobs")
    s3 = S3Backend(S3Location("bucket", "p/"), client=object())  # keys only: no request
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


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_check_stops_at_the_first_chunk_past_the_declared_size() -> None:
    """A body that would go on for 256 MiB is refused at the chunk that passes its size."""
    taken = 0

    def endless() -> Iterator[bytes]:
        nonlocal taken
        for _ in range(256):
            taken += 1
            yield b"\0" * (1 << 20)

    written: list[bytes] = []
    with pytest.raises(BlobTooLarge, match="larger than its declared 10 bytes"):
        copy_verified(endless(), written.append, digest=GOOD, size_bytes=10)
    assert taken == 1 and written == []


@pytest.mark.parametrize(
    ("data", "declared"),
    [(b"y", 1), (b"", 1), (b"x", 2), (b"z", None)],  # other bytes; short; short; no size
)
def test_other_bytes_or_another_length_are_a_mismatch_naming_both_digests(
    data: bytes, declared: int | None
) -> None:
    check = BlobCheck(digest=GOOD, size_bytes=declared, path="a/b")
    check.update(data)
    with pytest.raises(DigestMismatch) as raised:
        check.finish()
    assert not isinstance(raised.value, BlobTooLarge)
    assert raised.value.extra == {"path": "a/b", "expected": GOOD, "actual": _sha(data)}
    assert str(raised.value).startswith(f"blob {GOOD} for a/b is corrupt: ")
    verify_bytes(b"x", digest=GOOD, size_bytes=1)  # the right bytes pass


def test_the_hashing_reader_fails_on_a_short_or_long_body_and_maps_its_error() -> None:
    data = b"abc" * 1000
    digest = _sha(data)

    class Refused(Exception):
        pass

    def read_all(body: bytes, size: int) -> bytes:
        reader = HashingReader(
            io.BytesIO(body), digest=digest, size_bytes=size, refuse=lambda e: Refused(str(e))
        )
        with reader:
            out = reader.read()
            reader.check()
        return out

    assert read_all(data, len(data)) == data
    with pytest.raises(Refused, match="is corrupt"):  # ends early: at the read
        read_all(data[:-1], len(data))
    with pytest.raises(Refused, match="larger than its declared"):
        read_all(data + b"!", len(data))
    with pytest.raises(Refused, match="is corrupt"):  # same length, other bytes
        read_all(data[:-1] + b"!", len(data))
    reader = HashingReader(io.BytesIO(data[:10]), digest=digest, size_bytes=len(data))
    assert reader.read(100) == data[:10]
    with pytest.raises(DigestMismatch):  # no refuse: the check's own error, at the end
        reader.read(100)


def test_hash_file_and_digest_of(tmp_path: Path) -> None:
    data = bytes(range(256)) * 9000  # more than one CHUNK_BYTES read
    path = tmp_path / "f"
    path.write_bytes(data)
    assert hash_file(path) == (_sha(data), len(data)) and digest_of(data) == _sha(data)
