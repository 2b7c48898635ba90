"""8 restorers and 2 pushers at once against one server and one cache dir, 3 rounds.

Real processes: 8 ``cachekeeper pull`` into one shared cache dir while 2 ``cachekeeper
push`` publish new snapshots that share most blobs with it. After each round the shared
dir holds exactly the snapshot's files, byte for byte, and each pushed snapshot pulls
back complete into a fresh dir: no lost or corrupted file.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.hardening.conftest import ServerProcess, child_env, cli, visible_files

ROUNDS = 3
RESTORERS = 8
PUSHERS = 2


def test_8_restorers_and_2_pushers_at_once(
    server_process: ServerProcess, cache_tree: Path, tmp_path: Path, reliability
) -> None:
    server_process.start()
    url = server_process.url
    env = child_env(tmp_path / "home")
    base = subprocess.run(
        cli("push", str(cache_tree), "--workload", "base", "--allow-unregistered", "--server", url),
        env=env,
        capture_output=True,
        timeout=180,
    )
    assert base.returncode == 0, base.stderr
    expected = visible_files(cache_tree)
    pushed: dict[str, dict[str, bytes]] = {}
    for r in range(ROUNDS):
        sources = []
        for p in range(PUSHERS):
            src = tmp_path / f"src-{r}-{p}"
            shutil.copytree(cache_tree, src)
            (src / "extra").mkdir()
            (src / "extra" / f"r{r}p{p}.py").write_bytes(f"# round {r} pusher {p}\n".encode() * 999)
            sources.append(src)
        shared = tmp_path / f"shared-{r}"
        procs = [
            subprocess.Popen(
                cli("pull", "--workload", "base", "--server", url, "--cache-dir", str(shared)),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for _ in range(RESTORERS)
        ]
        procs += [
            subprocess.Popen(
                cli(
                    "push",
                    str(src),
                    "--workload",
                    src.name,
                    "--allow-unregistered",
                    "--server",
                    url,
                ),
                env=child_env(tmp_path / f"home-{p}"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for p, src in enumerate(sources)
        ]
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err.decode()[-2000:]
        got = visible_files(shared)
        assert set(got) == set(expected), "a restored file is lost or extra"
        for rel, data in got.items():
            if "__grp__" not in rel:  # group files are rewritten to the new root
                assert data == expected[rel], f"{rel} is corrupt"
        pushed.update({src.name: visible_files(src) for src in sources})
    for name, files in pushed.items():
        check = tmp_path / f"check-{name}"
        done = subprocess.run(
            cli("pull", "--workload", name, "--server", url, "--cache-dir", str(check)),
            env=env,
            capture_output=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr
        assert set(visible_files(check)) == set(files), f"snapshot {name} lost a file"
    reliability.record(
        f"{RESTORERS} `pull` and {PUSHERS} `push` processes at once on one server and one "
        f"cache dir ({len(expected)} files)",
        tries=ROUNDS,
        outcome="kept",
        area="concurrency",
    )
