"""The builder's errors, as a site meets them (issue 31): a cache dir that cannot be filled
is found before anything is compiled and every OS error's line names the full path; an
empty dir is not pushed. Real ``cachekeeper`` processes, a real immutable folder (root
ignores modes: ``chattr +i`` refuses it too), a real server on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachekeeper.restore.marker import unusable_reason
from tests.cli.conftest import ck
from tests.helpers.live_server import LiveServer

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "workloads" / "cpu-tiny.toml"


def _lock(folder: Path) -> bool:
    """Make ``folder`` refuse new entries for this process; False when this host cannot."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return True
    if shutil.which("chattr") is None:
        return False
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        (folder / "probe").write_bytes(b"")
    except OSError:
        return done
    (folder / "probe").unlink()
    return False


def _unlock(folder: Path) -> None:
    if os.geteuid() != 0:
        folder.chmod(0o755)
    else:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Path]:
    """An existing folder in a writable parent that refuses new entries (the site's case:
    a cache dir owned by another user, or immutable)."""
    folder = tmp_path / "parent" / "cache"
    folder.mkdir(parents=True)
    if not _lock(folder):
        pytest.skip("this host cannot make a folder refuse writes to root (no chattr +i)")
    try:
        yield folder
    finally:
        _unlock(folder)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no progress line: nothing was started
    return lines[0]


def test_the_probe_names_what_refuses_and_leaves_nothing(tmp_path: Path, locked: Path) -> None:
    assert unusable_reason(tmp_path / "new" / "cache") is None
    assert not (tmp_path / "new").exists()  # what the probe made, it removed
    reason = unusable_reason(locked)
    assert reason is not None and reason.startswith(f"cannot create a file in {locked}: ")
    assert unusable_reason(locked / "below") == (
        f"cannot create {locked / 'below'}: {os.strerror(1 if os.geteuid() == 0 else 13)}"
    )


@pytest.mark.slow  # a cachekeeper process
def test_prewarm_into_an_unusable_dir_fails_before_compiling(tmp_path: Path, locked: Path) -> None:
    proc = ck("prewarm", str(TINY), "--cache-dir", str(locked), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    assert line.startswith(f"error: cannot prewarm into {locked}: cannot create a file in {locked}")
    assert line.endswith("; nothing was compiled [cache_dir_unusable]"), line
    assert sorted(p.name for p in locked.parent.iterdir()) == ["cache"]  # no work area made


@pytest.mark.slow  # a cachekeeper process
def test_prewarm_with_an_unusable_state_folder_names_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / ".cachekeeper").mkdir(parents=True)
    if not _lock(cache / ".cachekeeper"):
        pytest.skip("this host cannot make a folder refuse writes to root (no chattr +i)")
    try:
        proc = ck("prewarm", str(TINY), "--cache-dir", str(cache), "--json", cwd=tmp_path)
    finally:
        _unlock(cache / ".cachekeeper")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert f"{cache / '.cachekeeper'}: " in one_error_line(proc)


@pytest.mark.slow  # cachekeeper processes against a server
def test_pull_and_restore_into_an_unusable_dir_name_the_full_path(
    tmp_path: Path, locked: Path, cache: Path, tiny_server: LiveServer
) -> None:
    pushed = ck("push", str(cache), "--workload", "cpu-tiny", "--server", tiny_server.url,
                cwd=tmp_path)  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    pulled = ck("pull", "--workload", "cpu-tiny", "--cache-dir", str(locked),
                "--server", tiny_server.url, cwd=tmp_path)  # fmt: skip
    assert pulled.returncode == 1
    line = one_error_line(pulled)
    assert line.startswith(f"error: {locked / '.cachekeeper'}: "), line  # never ".cachekeeper:"
    archive = tmp_path / "snap.tar.zst"
    assert ck("snapshot", str(cache), "-o", str(archive), cwd=tmp_path).returncode == 0
    restored = ck("restore", str(archive), "--cache-dir", str(locked), cwd=tmp_path)
    assert one_error_line(restored).startswith(f"error: {locked / '.cachekeeper'}: ")


@pytest.mark.slow  # cachekeeper processes against a server
def test_pushing_a_dir_with_nothing_cacheable_is_refused(
    tmp_path: Path, tiny_server: LiveServer
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = ck("push", str(empty), "--workload", "cpu-tiny", "--server", tiny_server.url,
              cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert line.startswith(f"error: nothing to push in {empty}: it is empty, so no file")
    assert "--allow-empty" in line and line.endswith("[empty_cache_dir]")

    (empty / "locks").mkdir()
    (empty / "locks" / "a.lock").write_bytes(b"")
    (empty / "x.tmp").write_bytes(b"")
    proc = ck("push", str(empty), "--workload", "cpu-tiny", "--server", tiny_server.url,
              cwd=tmp_path)  # fmt: skip
    assert "its 2 entries are all left out (locks, *.tmp" in one_error_line(proc)
    assert not (tmp_path / "home" / "snapshots").exists() or not any(
        (tmp_path / "home" / "snapshots").iterdir()
    )  # nothing saved locally either

    allowed = ck("push", str(empty), "--workload", "cpu-tiny", "--server", tiny_server.url,
                 "--allow-empty", "--json", cwd=tmp_path)  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["file_count"] == 0
