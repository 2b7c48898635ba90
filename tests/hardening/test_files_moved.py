"""Files moved under our feet (issue 32, class 7): a cache dir that changes between the
scan (or the plan) and the read (or the move), at exactly that moment.

Each test makes the swap for real at the seam between the two steps (the scan's return,
the plan handed to its ``execute``, the ``lstat`` before a read), proves that the swap
happened (the link is there), then checks that nothing outside the cache dir was read,
moved or deleted: a real push to a real server, a real repair move, a real prune with a
real process using the dir, real files with real modes.
"""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachekeeper.backends.local import LocalBackend
from cachekeeper.client.api import CacheClient
from cachekeeper.client.push import push
from cachekeeper.environment.fingerprint import collect
from cachekeeper.errors import CacheDirChanged, LinkInCacheDir
from cachekeeper.restore import merge_tree, restore_archive
from cachekeeper.restore.node_cache import plan_prune, scan_node_dirs
from cachekeeper.restore.repair import plan_set_aside
from cachekeeper.restore.writer import is_present
from cachekeeper.server.settings import Settings
from cachekeeper.snapshot import scan
from cachekeeper.snapshot.make import snapshot_dir, write_archive
from cachekeeper.snapshot.manifest import FileEntry
from cachekeeper.store import LocalStore
from tests.hardening.conftest import REPO, child_env, cli, sha
from tests.helpers.live_server import LiveServer, start_server

FP = {"schema": 1, "torch": "test", "gpus": []}
SECRET = b"-----BEGIN PRIVATE KEY----- not for any cache -----END PRIVATE KEY-----\n"
FILES = {
    "fxgraph/ab/key1/entry": b"graph one" * 200,
    "fxgraph/cd/key2/entry": b"graph two" * 100,
    "ab/cabc.py": b"print('hi')\n",
}


def _cache(root: Path) -> Path:
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the cache dir holding a 0600 secret, as ``key1/entry`` and as
    ``secret.key``: what a swapped link would lead a reader or a move to."""
    folder = tmp_path / "outside"
    (folder / "key1").mkdir(parents=True)
    for path in (folder / "key1" / "entry", folder / "secret.key"):
        path.write_bytes(SECRET)
        path.chmod(0o600)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with start_server(Settings(data_dir=tmp_path_factory.mktemp("server"))) as handle:
        yield handle


def _swap_file(cache: Path, outside: Path) -> str:
    """``fxgraph/cd/key2/entry`` becomes a link to the secret."""
    rel = "fxgraph/cd/key2/entry"
    (cache / rel).unlink()
    (cache / rel).symlink_to(outside / "secret.key")
    return rel


def _swap_folder(cache: Path, outside: Path) -> str:
    """``fxgraph/ab`` becomes a link to a folder whose ``key1/entry`` is the secret."""
    os.rename(cache / "fxgraph" / "ab", cache.parent / "moved-away")
    (cache / "fxgraph" / "ab").symlink_to(outside, target_is_directory=True)
    return "fxgraph/ab"


def _replace_file(cache: Path, outside: Path) -> str:
    """``ab/cabc.py`` is replaced (a rename over it) by another file: not the one scanned."""
    rel = "ab/cabc.py"
    (cache / "ab" / ".new").write_bytes(b"print('someone else')\n")
    os.rename(cache / "ab" / ".new", cache / rel)
    return rel


SWAPS: dict[str, tuple[Callable[[Path, Path], str], type[Exception]]] = {
    "file-to-link": (_swap_file, LinkInCacheDir),
    "folder-to-link": (_swap_folder, LinkInCacheDir),
    "file-replaced": (_replace_file, CacheDirChanged),
}


def _after_scan(monkeypatch: pytest.MonkeyPatch, swap: Callable[[], str]) -> list[str]:
    """The seam: the scan returns what it saw, then ``swap`` changes the dir, before any
    file is read. Returns the list the swapped path is appended to (proof it happened)."""
    done: list[str] = []
    real_scan = scan.CacheTree.scan

    def scan_then_swap(self: scan.CacheTree) -> list[scan.ScannedFile]:
        found = real_scan(self)
        if not done:
            done.append(swap())
        return found

    monkeypatch.setattr(scan.CacheTree, "scan", scan_then_swap)
    return done


@pytest.mark.parametrize("kind", sorted(SWAPS))
def test_push_never_uploads_what_was_swapped_in_after_the_scan(
    kind: str, tmp_path: Path, outside: Path, server: LiveServer, monkeypatch, reliability
) -> None:
    swap, refusal = SWAPS[kind]
    cache = _cache(tmp_path / "cache")
    store = LocalStore(home=tmp_path / "home")
    swapped = _after_scan(monkeypatch, lambda: swap(cache, outside))
    with CacheClient(base_url=server.url) as client:
        with pytest.raises(refusal) as refused:
            push(cache, client=client, workload=f"w-{kind}", store=store, fingerprint=FP)
        assert swapped, "the swap did not happen"
        if kind != "file-replaced":
            assert (cache / swapped[0]).is_symlink()
        assert swapped[0].split("/")[0] in refused.value.detail
        # nothing of the secret reached the local store or the server, and nothing published
        assert not store.blobs.has(sha(SECRET))
        assert client.missing([sha(SECRET)]).missing == (sha(SECRET),)
        assert [s for s in client.list_snapshots() if s.workload == f"w-{kind}"] == []
    assert (outside / "secret.key").read_bytes() == SECRET
    reliability.record(
        f"push: a cache entry swapped after the scan ({kind}): refused naming it, no byte of"
        " the 0600 file outside uploaded, nothing published",
        tries=1,
        outcome="refused",
        area="files moved under our feet",
    )


def test_a_merge_never_reads_a_link_swapped_in_after_the_scan(
    tmp_path: Path, outside: Path, monkeypatch, reliability
) -> None:
    src = _cache(tmp_path / "staging")
    dst = tmp_path / "cache"
    swapped = _after_scan(monkeypatch, lambda: _swap_file(src, outside))
    with pytest.raises(LinkInCacheDir):
        merge_tree(src, dst)
    assert swapped and (src / swapped[0]).is_symlink()
    leaked = [p for p in dst.rglob("*") if p.is_file() and p.read_bytes() == SECRET]
    assert leaked == []
    reliability.record(
        "prewarm's merge: a staging file swapped for a link after the scan: refused, the"
        " file outside never lands in the cache dir",
        tries=1,
        outcome="refused",
        area="files moved under our feet",
    )


def _conflicting_dir(tmp_path: Path) -> tuple[Path, Path]:
    """(an archive of ``FILES`` for this node, a cache dir where ``fxgraph/ab/key1/entry``
    holds other bytes: a conflict that --repair moves aside)."""
    store = LocalStore(home=tmp_path / "home")
    manifest = snapshot_dir(_cache(tmp_path / "src"), store=store, fingerprint=collect())
    archive = tmp_path / "snap.tar.zst"
    write_archive(manifest, store.blobs, archive)
    cache = _cache(tmp_path / "cache")
    (cache / "fxgraph/ab/key1/entry").write_bytes(b"someone's own version")
    return archive, cache


def test_repair_never_moves_through_a_folder_swapped_for_a_link_after_the_plan(
    tmp_path: Path, outside: Path, reliability
) -> None:
    archive, cache = _conflicting_dir(tmp_path)
    conflicts = restore_archive(archive, cache, dry_run=True).conflicts
    plan = plan_set_aside(cache, conflicts)
    assert plan.paths == ("fxgraph/ab/key1/entry",)
    _swap_folder(cache, outside)  # between the plan and its execution
    assert (cache / "fxgraph/ab").is_symlink()
    moved = plan.execute()
    assert moved == []
    assert (outside / "key1" / "entry").read_bytes() == SECRET  # not moved into the cache
    assert not (plan.folder / "fxgraph/ab/key1/entry").exists()
    # the same plan on the real folder moves the file (the seam is the only difference)
    os.unlink(cache / "fxgraph" / "ab")
    os.rename(cache.parent / "moved-away", cache / "fxgraph" / "ab")
    assert plan_set_aside(cache, conflicts).execute() == ["fxgraph/ab/key1/entry"]
    reliability.record(
        "restore --repair: a folder swapped for a link between plan and execute: nothing"
        " moved through it (the file outside stays where it is)",
        tries=1,
        outcome="kept",
        area="files moved under our feet",
    )


def test_repair_moves_only_the_file_it_planned(tmp_path: Path, reliability) -> None:
    archive, cache = _conflicting_dir(tmp_path)
    plan = plan_set_aside(cache, restore_archive(archive, cache, dry_run=True).conflicts)
    target = cache / "fxgraph/ab/key1/entry"
    (target.parent / ".other").write_bytes(b"a file that arrived after the plan")
    os.rename(target.parent / ".other", target)
    assert plan.execute() == []
    assert target.read_bytes() == b"a file that arrived after the plan"
    reliability.record(
        "restore --repair: the planned file replaced by another before the move: left as"
        " it is (only the very file planned is moved)",
        tries=1,
        outcome="kept",
        area="files moved under our feet",
    )


@pytest.mark.parametrize("swap_to", ["fifo", "link"])
def test_the_restore_check_never_reads_what_was_swapped_in_after_its_lstat(
    swap_to: str, tmp_path: Path, outside: Path, monkeypatch, reliability
) -> None:
    """A file in place is ``lstat``-ed, then read to compare: a FIFO swapped in between
    must not hang the restore, a link must not be read (its target has the very bytes)."""
    cache = tmp_path / "cache"
    final = cache / "fxgraph/ab/key1/entry"
    final.parent.mkdir(parents=True)
    final.write_bytes(b"x" * len(SECRET))  # the size the manifest says: it is then read
    entry = FileEntry("fxgraph/ab/key1/entry", sha(SECRET), len(SECRET), 0o644)
    swapped: list[str] = []
    real_lstat = Path.lstat

    def lstat_then_swap(self: Path) -> os.stat_result:
        found = real_lstat(self)
        if self == final and not swapped:
            final.unlink()
            if swap_to == "fifo":
                os.mkfifo(final)
            else:
                final.symlink_to(outside / "secret.key")
            swapped.append(swap_to)
        return found

    monkeypatch.setattr(Path, "lstat", lstat_then_swap)
    verdict: list[bool | None] = []
    worker = threading.Thread(
        target=lambda: verdict.append(is_present(entry, final, {entry.path}, cache)),
        daemon=True,
    )
    worker.start()
    worker.join(15)
    if worker.is_alive():  # unblock the old code's open of the FIFO, then fail
        with open(final, "wb"):
            pass
        pytest.fail("the restore's check hung on a FIFO swapped in after its lstat")
    assert swapped == [swap_to]
    assert verdict == [False]  # a conflict: something else is there; never "present"
    reliability.record(
        f"restore: a file in place swapped for a {swap_to} between its lstat and its read:"
        " a conflict, never read through, never a hang",
        tries=1,
        outcome="kept",
        area="files moved under our feet",
    )


def test_prune_keeps_a_running_jobs_dir_named_through_a_linked_home(
    tmp_path: Path, reliability
) -> None:
    real_home = tmp_path / "real-home"
    linked_home = tmp_path / "home-link"
    real_home.mkdir()
    linked_home.symlink_to(real_home, target_is_directory=True)
    other = "0123456789abcdef"  # another environment's dir: pruned unless in use
    node_dir = real_home / "inductor" / other
    (node_dir / "fxgraph").mkdir(parents=True)
    (node_dir / "fxgraph" / "entry").write_bytes(b"a running job's cache")
    job_env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(linked_home / "inductor" / other)}
    job = subprocess.Popen(["sleep", "60"], env=job_env, cwd=tmp_path)  # uses it by name only
    try:
        proc = subprocess.run(
            cli("cache", "prune", other, "--yes", "--json"),
            env=child_env(linked_home),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert job.poll() is None  # the job ran throughout
    finally:
        job.kill()
        job.wait()
    assert proc.returncode == 0, proc.stderr
    assert node_dir.is_dir() and (node_dir / "fxgraph" / "entry").exists()
    assert f"process {job.pid} uses" in proc.stdout
    reliability.record(
        "cache prune with the home reached through a link while a job uses the dir by that"
        " name: kept (in-use checks compare real paths)",
        tries=1,
        outcome="kept",
        area="files moved under our feet",
    )


def test_prune_never_deletes_through_a_folder_swapped_after_the_plan(
    tmp_path: Path, monkeypatch, reliability
) -> None:
    home = tmp_path / "home"
    other = "fedcba9876543210"
    (home / "inductor" / other).mkdir(parents=True)
    (home / "inductor" / other / "entry").write_bytes(b"an old environment's cache")
    victim = tmp_path / "victim"
    (victim / other).mkdir(parents=True)
    (victim / other / "precious").write_bytes(b"not a cache")
    env = {**os.environ, "CACHEKEEPER_HOME": str(home)}
    plan = plan_prune(scan_node_dirs(env), older_than_s=0, names=[other])
    assert [d.fingerprint for d in plan.dirs] == [other]
    os.rename(home / "inductor", tmp_path / "inductor-moved")  # between plan and execute
    (home / "inductor").symlink_to(victim, target_is_directory=True)
    assert plan.execute() == []
    assert (victim / other / "precious").read_bytes() == b"not a cache"
    reliability.record(
        "cache prune: the folder of the planned dir swapped for a link to another folder"
        " between plan and execute: nothing deleted there",
        tries=1,
        outcome="kept",
        area="files moved under our feet",
    )


def test_gc_never_deletes_a_blob_through_a_shard_swapped_for_a_link(
    tmp_path: Path, reliability
) -> None:
    blobs = LocalBackend(tmp_path / "blobs")
    data = b"a blob"
    digest = sha(data)
    blobs.put([data], digest=digest)
    shard = blobs.path_for(digest).parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"{digest}.zst").write_bytes(b"someone's file of that name")
    os.rename(shard, tmp_path / "shard-moved")
    shard.symlink_to(elsewhere, target_is_directory=True)
    assert blobs.delete(digest) is False
    assert (elsewhere / f"{digest}.zst").exists()
    reliability.record(
        "blob store delete (local gc, server gc): a shard folder swapped for a link:"
        " nothing deleted through it",
        tries=1,
        outcome="kept",
        area="files moved under our feet",
    )


@pytest.mark.slow  # two CLI processes (prejob, keygen)
def test_secrets_are_written_0600_from_their_creation(tmp_path: Path, reliability) -> None:
    """Under ``umask 000`` (a shared host's worst), the env file (which may carry the
    node's token in the tier's URL) and a signing key are 0600, and an older 0644 env
    file is replaced by a 0600 one, not rewritten in place."""
    env_file = tmp_path / "prejob.env"
    env_file.write_text("export OLD=1\n")
    env_file.chmod(0o644)
    old_inode = env_file.stat().st_ino

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cli(*args),
            env=child_env(tmp_path / "home"),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            preexec_fn=lambda: os.umask(0),  # noqa: PLW1509
        )

    proc = run("prejob", "--workload", "w", "--cache-dir", str(tmp_path / "c"),
               "--env-file", str(env_file))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "TORCHINDUCTOR_CACHE_DIR" in env_file.read_text()
    assert env_file.stat().st_ino != old_inode
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    keys = run("keygen", "--out", str(tmp_path / "keys" / "builder"))
    assert keys.returncode == 0, keys.stderr
    assert stat.S_IMODE((tmp_path / "keys" / "builder.key").stat().st_mode) == 0o600
    assert [p.name for p in (tmp_path / "keys").iterdir() if p.name.startswith(".")] == []
    reliability.record(
        "prejob --env-file and keygen under umask 000: the env file and the private key"
        " are 0600 from their creation (an old 0644 env file replaced, not rewritten)",
        tries=1,
        outcome="kept",
        area="files moved under our feet",
    )
