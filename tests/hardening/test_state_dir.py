"""Links and modes in the node's own state (issue 24).

Another local user who can write in a shared cache dir plants links inside
``.cachekeeper/`` (its lock, staging or restored markers pointing outside): a root pre-job
hook must never follow them. A snapshot whose manifest asks for world-writable files must
not get them (another user would rewrite a kernel the next job loads), and a file changed
since its restore must not pass the next job's already-restored check. The real CLI (as
root here) against a real server on loopback; real files and links.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from cachekeeper.client.api import CacheClient
from cachekeeper.client.push import push
from cachekeeper.fingerprint import collect
from tests.hardening.conftest import child_env, cli
from tests.helpers.live_server import LiveServer

FILES = {
    "fxgraph/ab/key1/entry": b"graph entry" * 100,
    "ab/kernel.py": b"def kernel():\n    pass\n",
    "cd/kernel.so": b"\x7fELF" + b"k" * 5000,
}


def _pushed(server: LiveServer, tmp_path: Path, *, mode: int = 0o644) -> str:
    src = tmp_path / "src"
    for rel, data in FILES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
        (src / rel).chmod(mode)
    with CacheClient(base_url=server.url) as client:
        report = push(src, client=client, workload="wl", fingerprint=collect(), store=None)
    return report.snapshot_id


def _prejob(server: LiveServer, cache: Path, home: Path, *, umask: int | None = None):  # type: ignore[no-untyped-def]
    return subprocess.run(
        cli(
            "prejob",
            "--workload",
            "wl",
            "--server",
            server.url,
            "--cache-dir",
            str(cache),
            "--timeout",
            "20",
        ),
        env=child_env(home),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=None if umask is None else (lambda: os.umask(umask)),  # noqa: PLW1509
    )


def _everything(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` (links as their target), to compare before and after."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = f"-> {os.readlink(path)}"
        elif path.is_file():
            out[rel] = path.read_bytes()
        else:
            out[rel] = "dir"
    return out


PLANTS = {
    "lock": "a dangling link to outside/lockfile",
    "staging": "a link to the outside folder",
    "restored": "a link to the outside folder",
}


@pytest.mark.parametrize("planted", sorted(PLANTS))
def test_a_link_planted_in_the_state_folder_is_never_followed(
    planted: str, open_server: LiveServer, tmp_path: Path, reliability
) -> None:
    _pushed(open_server, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"someone else's")
    cache = tmp_path / "cache"
    (cache / ".cachekeeper").mkdir(parents=True)
    target = outside / "lockfile" if planted == "lock" else outside
    (cache / ".cachekeeper" / planted).symlink_to(target)
    before = _everything(outside)
    proc = _prejob(open_server, cache, tmp_path / "home")
    assert proc.returncode == 0, proc.stderr
    assert _everything(outside) == before, f"{planted}: the hook wrote outside the cache dir"
    assert os.readlink(cache / ".cachekeeper" / planted) == str(target)  # left as it was
    assert "this job will compile cold" in proc.stderr
    assert f".cachekeeper/{planted} is a link" in proc.stderr, proc.stderr
    reliability.record(
        f"`.cachekeeper/{planted}` planted as {PLANTS[planted]}, root `prejob`: nothing"
        " created outside the cache dir, the link left alone, a cold start naming it",
        tries=1,
        outcome="refused",
        area="planted links",
    )


def test_restored_files_are_never_group_or_other_writable(
    open_server: LiveServer, tmp_path: Path, reliability
) -> None:
    _pushed(open_server, tmp_path, mode=0o777)  # the manifest asks for world-writable files
    cache = tmp_path / "cache"
    proc = _prejob(open_server, cache, tmp_path / "home", umask=0)  # and nothing masks them
    assert proc.returncode == 0, proc.stderr
    assert "restored snapshot" in proc.stderr, proc.stderr
    for rel in FILES:
        mode = stat.S_IMODE((cache / rel).stat().st_mode)
        assert mode & 0o022 == 0, f"{rel} restored as {oct(mode)}"
        assert mode == 0o755, oct(mode)  # the rest of the manifest's mode is kept
    for folder in [p for p in cache.rglob("*") if p.is_dir()]:
        assert stat.S_IMODE(folder.stat().st_mode) & 0o022 == 0, folder
    reliability.record(
        "snapshot whose manifest gives its files mode 0o777, restored under umask 0: files"
        " 0o755, every folder cachekeeper made without group or other write",
        tries=1,
        outcome="kept",
        area="planted links",
    )


def test_a_file_changed_since_the_restore_is_not_already_restored(
    open_server: LiveServer, tmp_path: Path, reliability
) -> None:
    snapshot_id = _pushed(open_server, tmp_path)
    cache, home = tmp_path / "cache", tmp_path / "home"
    assert _prejob(open_server, cache, home).returncode == 0
    again = _prejob(open_server, cache, home)
    assert "restored snapshot" not in again.stderr  # untouched: the fast no-op path
    kernel = cache / "ab" / "kernel.py"
    tampered = b"import os;os.system('x')"[: len(FILES["ab/kernel.py"])].ljust(
        len(FILES["ab/kernel.py"]), b"#"
    )
    with open(kernel, "r+b") as fh:  # rewritten in place by another user: same size
        fh.write(tampered)
    proc = _prejob(open_server, cache, home)
    assert proc.returncode == 0, proc.stderr
    assert "differ from snapshot" in proc.stderr and "ab/kernel.py" in proc.stderr, proc.stderr
    assert kernel.read_bytes() == tampered  # kept as it was: never delete what we did not write
    report = subprocess.run(
        cli(
            "prejob",
            "--workload",
            "wl",
            "--server",
            open_server.url,
            "--cache-dir",
            str(cache),
            "--json",
        ),
        env=child_env(home),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert '"already_restored"' not in report.stdout, report.stdout
    assert snapshot_id[:12] in proc.stderr
    reliability.record(
        "a restored file rewritten in place (same size) by another user: the next `prejob`"
        " is not `already_restored` (size and mtime against the marker), reports the"
        " changed file and keeps it",
        tries=1,
        outcome="kept",
        area="planted links",
    )
