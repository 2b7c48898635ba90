"""Atomic writes: the file appears whole or not at all, and nothing temporary is left."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from cachekeeper.fsutil import atomic_write_bytes, atomic_write_text, atomic_writer, unwritable_dir


def test_writes_replace_whole_and_leave_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_write_text(target, "one")
    atomic_write_bytes(target, b"two", mode=0o600)
    assert target.read_bytes() == b"two"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_writer(target) as out:
        out.write(b"half of the new")
        raise RuntimeError("interrupted")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_missing_folder_is_an_error_not_a_partial_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write_text(tmp_path / "no" / "f", "x")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_dir_proves_it_by_writing_and_leaves_nothing(tmp_path: Path) -> None:
    made = tmp_path / "new" / "cache"
    assert unwritable_dir(made) is None
    assert made.is_dir() and list(made.iterdir()) == []  # an unnamed file: nothing visible
    (tmp_path / "a-file").write_text("x")
    assert unwritable_dir(tmp_path / "a-file") == "it is not a folder"
    assert unwritable_dir(tmp_path / "a-file" / "below") == "a part of its path is a file"
    assert (tmp_path / "a-file").read_text() == "x"
