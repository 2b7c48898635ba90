"""kill -9 of ``cachekeeper restore`` and ``cachekeeper prejob`` at random points.

Real processes and files: each iteration starts the command on a cache dir that already
holds one unrelated file, SIGKILLs it after a random delay spread over its measured run
time, and checks that the dir holds only that file, untouched, and files that are
complete and equal to the snapshot's (never a partial file outside the dot staging
folder). Then the same command runs again and must complete the restore.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachekeeper.environment.fingerprint import collect
from cachekeeper.restore import is_restored
from cachekeeper.restore.triton_groups import is_group_path, rewrite_group
from cachekeeper.snapshot.make import snapshot_dir, write_archive
from cachekeeper.store import LocalStore
from tests.hardening.conftest import child_env, cli, visible_files
from tests.helpers.live_server import LiveServer, start_server

ITERATIONS = 12
PRE_EXISTING = ("unrelated/keep.txt", b"a file the restore must not touch\n")


def _seed_dir(target: Path) -> None:
    rel, data = PRE_EXISTING
    (target / rel).parent.mkdir(parents=True, exist_ok=True)
    (target / rel).write_bytes(data)


def _check_only_complete_files(target: Path, expected: dict[str, bytes]) -> int:
    """Assert the invariant; return how many snapshot files are already there."""
    found = visible_files(target)
    rel, data = PRE_EXISTING
    assert found.pop(rel) == data, "the pre-existing file changed"
    for path, content in found.items():
        assert path in expected, f"{path} is not a snapshot file"
        want = expected[path]
        if is_group_path(path):  # Triton group files name their children by absolute path
            want = rewrite_group(want, paths=set(expected), root=target)
        assert content == want, f"{path} is partial or corrupt"
    return len(found)


def _timed_run(cmd: list[str], env: dict[str, str]) -> float:
    started = time.monotonic()
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=120)
    return time.monotonic() - started


def _kill_loop(
    make_cmd, target_of, expected: dict[str, bytes], env: dict[str, str], full_s: float
) -> tuple[int, int]:
    """Run ITERATIONS kill + check + rerun rounds; (kills mid-write, kills).

    A kill is mid-write when it left staged temp files or some but not all files.
    """
    rng = random.Random(1234)
    partial = 0
    for i in range(ITERATIONS):
        target = target_of(i)
        _seed_dir(target)
        proc = subprocess.Popen(
            make_cmd(target), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        # Interpreter start-up takes much of a run: aim most kills at the writing part.
        time.sleep(rng.uniform(0.3 * full_s, full_s))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        present = _check_only_complete_files(target, expected)
        staging = target / ".cachekeeper" / "staging"
        staged = staging.is_dir() and any(p.is_file() for p in staging.rglob("*"))
        partial += staged or 0 < present < len(expected)
        rerun = subprocess.run(make_cmd(target), env=env, capture_output=True, timeout=120)
        assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
        assert _check_only_complete_files(target, expected) == len(expected)
    return partial, ITERATIONS


@pytest.fixture(scope="module")
def archive(cache_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("kill-home")
    store = LocalStore(home=home)
    # this node's own fingerprint: `cachekeeper restore` refuses another environment's
    manifest = snapshot_dir(cache_tree, store=store, fingerprint=collect())
    out = home / "snap.tar.zst"
    write_archive(manifest, store.blobs, out)
    yield out


def test_kill_9_restore_at_random_points(
    archive: Path, cache_tree: Path, tmp_path: Path, reliability
) -> None:
    expected = visible_files(cache_tree)
    env = child_env(tmp_path / "home")

    def make_cmd(target: Path) -> list[str]:
        return cli("restore", str(archive), "--cache-dir", str(target))

    full_s = _timed_run(make_cmd(tmp_path / "timing"), env)
    partial, kills = _kill_loop(make_cmd, lambda i: tmp_path / f"t{i}", expected, env, full_s)
    assert partial >= 1, "no kill landed mid-restore; the delays do not cover the restore"
    reliability.record(
        f"kill -9 of `cachekeeper restore` at a random point ({len(expected)} files, "
        f"{partial} kills mid-write)",
        tries=kills,
        outcome="kept",
        area="process killed",
    )
    reliability.record(
        "rerun of `cachekeeper restore` after a kill -9",
        tries=kills,
        outcome="recovered",
        area="process killed",
    )


@pytest.fixture(scope="module")
def pushed(cache_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from cachekeeper.server.settings import Settings

    data = tmp_path_factory.mktemp("kill-server")
    handle = start_server(Settings(data_dir=data / "data"))
    home = data / "home"
    subprocess.run(
        cli(
            "push",
            str(cache_tree),
            "--workload",
            "hardening",
            "--allow-unregistered",
            "--server",
            handle.url,
        ),
        env=child_env(home),
        check=True,
        capture_output=True,
        timeout=180,
    )
    try:
        yield handle
    finally:
        handle.stop()


def test_kill_9_prejob_at_random_points(
    pushed: LiveServer, cache_tree: Path, tmp_path: Path, reliability
) -> None:
    expected = visible_files(cache_tree)
    env = child_env(tmp_path / "home")

    def make_cmd(target: Path) -> list[str]:
        return cli(
            "prejob",
            "--workload",
            "hardening",
            "--server",
            pushed.url,
            "--cache-dir",
            str(target),
            "--strict",
        )

    full_s = _timed_run(make_cmd(tmp_path / "timing"), env)
    partial, kills = _kill_loop(make_cmd, lambda i: tmp_path / f"t{i}", expected, env, full_s)
    for i in range(ITERATIONS):
        assert (tmp_path / f"t{i}" / ".cachekeeper" / "restored").is_dir()
    restored = tmp_path / "timing" / ".cachekeeper" / "restored"
    assert is_restored(next(restored.iterdir()).name, tmp_path / "timing")
    assert partial >= 1, "no kill landed mid-restore; the delays do not cover the restore"
    reliability.record(
        f"kill -9 of `cachekeeper prejob` at a random point ({partial} kills mid-write)",
        tries=kills,
        outcome="kept",
        area="process killed",
    )
    reliability.record(
        "rerun of `cachekeeper prejob` after a kill -9",
        tries=kills,
        outcome="recovered",
        area="process killed",
    )
