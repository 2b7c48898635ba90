"""Manifest validation: the one place a snapshot's validity is decided."""

from __future__ import annotations

import hashlib
import json

import pytest

from cachekeeper.errors import InvalidManifest, UnsafePath, UnsupportedFormat
from cachekeeper.snapshot.manifest import FileEntry, Manifest, check_relpath

D = hashlib.sha256(b"x").hexdigest()


def raw(**over: object) -> dict:
    body = {
        "format": 1,
        "fingerprint": {"torch": "t"},
        "devices": ["cpu"],
        "files": [{"path": "a/b", "digest": D, "size_bytes": 1, "mode": 0o644}],
    }
    body.update(over)
    return body


def test_round_trip_and_id_ignores_signature() -> None:
    m = Manifest.from_dict(raw())
    again = Manifest.from_json(m.to_json())
    assert again == m and again.id == m.id
    assert m.with_signature({"key_id": "k", "signature": "s"}).id == m.id
    assert len(m.id) == 64


def test_id_changes_with_content() -> None:
    a = Manifest.from_dict(raw())
    b = Manifest.from_dict(raw(workload="other"))
    assert a.id != b.id


@pytest.mark.parametrize("path", ["/abs", "../up", "a/../b", "a//b", "./a", "a\\b", "a\x00b", ""])
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(UnsafePath):
        check_relpath(path)
    with pytest.raises(UnsafePath):
        Manifest.from_dict(raw(files=[{"path": path, "digest": D, "size_bytes": 1}]))


def test_duplicates_and_file_folder_clash_are_refused() -> None:
    entry = {"path": "a", "digest": D, "size_bytes": 1}
    with pytest.raises(InvalidManifest, match="twice"):
        Manifest.from_dict(raw(files=[entry, entry]))
    with pytest.raises(InvalidManifest, match="both a file and a folder"):
        Manifest.from_dict(raw(files=[entry, {**entry, "path": "a/b"}]))


@pytest.mark.parametrize(
    "bad",
    [
        {"digest": "ABC"},
        {"size_bytes": -1},
        {"size_bytes": True},
        {"mode": 0o4755},
    ],
)
def test_bad_entry_fields_are_refused(bad: dict) -> None:
    with pytest.raises(InvalidManifest, match="a/b"):
        Manifest.from_dict(raw(files=[{"path": "a/b", "digest": D, "size_bytes": 1, **bad}]))


def test_unknown_format_and_bad_json() -> None:
    with pytest.raises(UnsupportedFormat):
        Manifest.from_dict(raw(format=2))
    with pytest.raises(InvalidManifest):
        Manifest.from_json("{not json")
    with pytest.raises(InvalidManifest, match="fingerprint_digest"):
        Manifest.from_dict(raw(fingerprint_digest="0" * 64))


def test_files_are_sorted_and_verified_flag() -> None:
    m = Manifest(
        files=(FileEntry("b", D, 1), FileEntry("a", D, 1)),
        fingerprint={},
        stats={"verify": {"effective": True}},
    )
    assert [f.path for f in m.files] == ["a", "b"]
    assert m.verified and m.digests == {D} and m.size_bytes == 2
    assert json.loads(m.to_json())["files"][0]["path"] == "a"


def test_the_fingerprint_is_parsed_naming_a_bad_field_and_kept_as_sent() -> None:
    with pytest.raises(InvalidManifest, match="manifest 'fingerprint' is not an object"):
        Manifest.from_dict(raw(fingerprint=["torch"]))
    bad = {"torch": "t", "cpu": {"threads": 2, "threads_from": "x", "isa": 5}}
    with pytest.raises(InvalidManifest, match=r"'fingerprint' field cpu\.isa: expected a string"):
        Manifest.from_dict(raw(fingerprint=bad))
    newer = {"torch": "t", "schema": 7, "compiler": {"cxx": "g++"}}  # a newer cachekeeper's
    m = Manifest.from_dict(raw(fingerprint=newer))
    assert m.fingerprint == newer and Manifest.from_json(m.to_json()).id == m.id
