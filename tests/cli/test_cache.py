"""``cachekeeper cache ls`` / ``cache prune`` (issue 25): the hook's per-fingerprint dirs.

Real dirs under a private ``CACHEKEEPER_HOME``, a real restore marker, and a real process
that uses one dir (its ``TORCHINDUCTOR_CACHE_DIR`` and working dir), which prune must keep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachekeeper.cli import cli
from cachekeeper.environment.fingerprint import collect, digest_of
from cachekeeper.restore import restore
from cachekeeper.snapshot.make import snapshot_dir
from cachekeeper.store import LocalStore
from tests.helpers.caches import make_cache

DAY = 86400


def run(*args: str, home: Path, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), env={"CACHEKEEPER_HOME": str(home)})
    assert result.exit_code == code, result.output
    return result.output


def age(path: Path, days: float) -> None:
    then = time.time() - days * DAY
    for p in [path, *path.rglob("*")]:
        os.utime(p, (then, then), follow_symlinks=False)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    home = tmp_path / "home"
    monkeypatch.setenv("CACHEKEEPER_HOME", str(home))
    root = home / "inductor"
    ranks = digest_of(collect(environ={"OMP_NUM_THREADS": "1"}))[:16]  # torchrun's ranks
    dirs = {"ours": root / ranks, "old": root / ("a" * 16), "recent": root / ("b" * 16),
            "busy": root / ("c" * 16)}  # fmt: skip
    src = tmp_path / "src"
    make_cache(src)
    store = LocalStore(home=tmp_path / "store")
    manifest = snapshot_dir(src, store=store, fingerprint=collect())
    for path in dirs.values():
        restore(manifest, store.blobs, path)
    for name in ("ours", "old", "busy"):
        age(dirs[name], 30)
    (root / "notours").mkdir()
    (root / ("d" * 16)).symlink_to(src)  # a link with a hook-like name: never followed
    user = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        cwd=dirs["busy"],
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(dirs["busy"])},
    )
    try:
        yield home, dirs, manifest, user
    finally:
        user.kill()
        user.wait()


def test_cache_ls_shows_each_dir_and_prune_keeps_what_is_used(node) -> None:
    home, dirs, manifest, user = node
    rows = {
        Path(r["path"]).name: r for r in json.loads(run("cache", "ls", "--json", home=home))["dirs"]
    }
    assert set(rows) == {d.name for d in dirs.values()}  # not the link, not "notours"
    ours, old, busy = rows[dirs["ours"].name], rows[dirs["old"].name], rows[dirs["busy"].name]
    assert ours["matches_node"] and not old["matches_node"]
    assert old["snapshot_id"] == manifest.id
    assert manifest.size_bytes < old["size_bytes"] < manifest.size_bytes + 4096  # + our marker
    assert busy["in_use"] and f"process {user.pid}" in busy["in_use"]
    assert old["in_use"] is None and old["last_used_at"] < rows[dirs["recent"].name]["last_used_at"]
    table = run("cache", "ls", home=home)
    assert "this node" in table and "(in use)" in table

    dry = json.loads(run("cache", "prune", "--dry-run", "--json", home=home))
    assert dry["dirs_removed"] == [str(dirs["old"])] and dry["bytes_freed"] == old["size_bytes"]
    assert all(d.exists() for d in dirs.values())
    kept = {Path(k["path"]).name: k["why"] for k in dry["kept"]}
    assert "in use" in kept[dirs["busy"].name] and "this node" in kept[dirs["ours"].name]
    assert "ago" in kept[dirs["recent"].name]

    out = run("cache", "prune", "--yes", home=home)
    assert f"deleted {dirs['old']}" in out and not dirs["old"].exists()
    assert all(dirs[n].exists() for n in ("ours", "recent", "busy"))
    assert (home / "inductor" / "notours").is_dir() and (
        home / "inductor" / ("d" * 16)
    ).is_symlink()

    named = run("cache", "prune", "cccc", "--yes", home=home)  # named, but in use
    assert "kept" in named and dirs["busy"].exists()
    user.kill()
    user.wait()
    run("cache", "prune", "cccc", "--yes", home=home)
    assert not dirs["busy"].exists()
    assert "is not an age" in run("cache", "prune", "--older-than", "soon", home=home, code=2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for taskset")
@pytest.mark.parametrize(
    ("env", "taskset"),
    [
        ({"MKL_NUM_THREADS": "1"}, False),  # a job that sets MKL's, not OMP's
        ({"OMP_NUM_THREADS": "64"}, False),  # more than the CPUs: torch uses the CPUs
        ({}, True),  # under taskset -c 0: 1 thread from the affinity
    ],
)
def test_prune_never_deletes_a_dir_the_hook_made_at_any_thread_count(
    tmp_path: Path, env: dict[str, str], taskset: bool
) -> None:
    # Issue 31: the help promised "never this node's environment's dir (at any thread
    # count)", but the digest held where the count came from: a dir the hook made with
    # MKL_NUM_THREADS=1, OMP_NUM_THREADS above the CPUs, or under taskset was deleted.
    home = tmp_path / "home"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCHIN"))}
    base.pop("OMP_NUM_THREADS", None)
    base.pop("MKL_NUM_THREADS", None)
    ck = str(Path(sys.executable).parent / "cachekeeper")
    prefix = ["taskset", "-c", "0"] if taskset else []
    hook = subprocess.run(
        [*prefix, ck, "prejob", "--workload", "w", "--no-report", "--timeout", "5"],
        env={**base, **env, "CACHEKEEPER_HOME": str(home), "CACHEKEEPER_SERVER": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    made = [p for p in (home / "inductor").iterdir()]
    assert len(made) == 1 and hook.stdout == f"export TORCHINDUCTOR_CACHE_DIR={made[0]}\n", hook
    age(made[0], 30)
    proc = subprocess.run(
        [ck, "cache", "prune", "--older-than", "1d", "--json"],
        env={**base, "CACHEKEEPER_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    body = json.loads(proc.stdout)
    assert body["dirs_removed"] == [] and made[0].is_dir(), body
    assert body["kept"] == [{"path": str(made[0]), "why": "this node's environment uses it"}]
