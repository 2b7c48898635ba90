"""Benchmark the pre-job hook end to end on loopback.

    .venv/bin/python bench/prejob_bench.py [--size-mb 350] [--repeat 3] [--noop-repeat 10]

1. Build the synthetic cache (bench/synthetic_cache.py), start ``cachekeeper serve`` on
   127.0.0.1 in its own process (bench/_server.py) and push the cache to it.
2. Download the snapshot's whole archive once to a local file (the same bytes the hook
   streams): the baseline is ``zstd -d -c ARCHIVE | tar -x -C DIR`` into an empty dir.
3. ``cachekeeper prejob`` (a fresh process each time) into an empty dir. Target: at most
   1.5x the baseline.
4. ``cachekeeper prejob`` when the dir already holds the snapshot (the no-op path every
   job start takes). Target: under 300 ms. ``python -c pass`` is shown for scale.

Two more rows split the cold path into its parts (informational, no target): the archive
download alone (``curl`` to /dev/null, the server's side and loopback), and
``cachekeeper restore ARCHIVE`` from the local file (the restore code alone).

Each case is timed ``--repeat`` times and the median reported; ratios are against the
baseline measured in the same run. Results print as a table (``--json`` for a JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._server import CK_ARGS, serve  # noqa: E402  (after the path insert)


def timed(cmd: list[str] | str, *, env: dict[str, str] | None = None, shell: bool = False) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, shell=shell, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0 or (not shell and "no cache restored" in proc.stderr):
        raise SystemExit(f"benchmark command failed: {cmd}\n{proc.stderr}")
    return elapsed


def dir_bytes(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file() and ".cachekeeper" not in p.parts]
    return len(files), sum(p.stat().st_size for p in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=350)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--noop-repeat", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import httpx

    from bench.synthetic_cache import make_synthetic_cache
    from cachekeeper.client.api import CacheClient
    from cachekeeper.client.push import push
    from cachekeeper.restore import is_restored
    from cachekeeper.store import LocalStore

    work = Path(tempfile.mkdtemp(prefix="ck-prejob-bench-"))
    try:
        src = work / "src"
        make_synthetic_cache(src, size_mb=args.size_mb, seed=0)
        file_count, total_bytes = dir_bytes(src)
        with serve(work / "server") as server:
            with CacheClient(base_url=server.url) as client:
                pushed = push(
                    src, client=client, workload="bench", store=LocalStore(home=work / "home")
                )
            archive = work / "snapshot.tar.zst"
            with httpx.stream(
                "GET", f"{server.url}/v1/snapshots/{pushed.snapshot_id}/archive", timeout=600
            ) as response:
                response.raise_for_status()
                with open(archive, "wb") as out:
                    for chunk in response.iter_raw(1 << 20):
                        out.write(chunk)

            # Like an installed package: byte-code cached (here under a private prefix).
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith("CACHEKEEPER_") and k != "PYTHONDONTWRITEBYTECODE"
            }
            env.update(
                CACHEKEEPER_SERVER=server.url,
                CACHEKEEPER_HOME=str(work / "node-home"),
                PYTHONPYCACHEPREFIX=str(work / "pycache"),
            )
            warm = [*CK_ARGS, "prejob", "--workload", "absent", "--cache-dir", str(work / "warm")]
            subprocess.run(warm, env=env, capture_output=True)  # writes the byte-code
            baseline, cold, noop, bare, download, local = [], [], [], [], [], []
            archive_url = f"{server.url}/v1/snapshots/{pushed.snapshot_id}/archive"
            for i in range(args.repeat):
                dst = work / f"tar-{i}"
                dst.mkdir()
                baseline.append(timed(f"zstd -q -d -c '{archive}' | tar -x -C '{dst}'", shell=True))
                shutil.rmtree(dst)
                download.append(timed(["curl", "-sSf", "-o", "/dev/null", archive_url]))
                dst = work / f"restore-{i}"
                local.append(
                    timed([*CK_ARGS, "restore", str(archive), "--cache-dir", str(dst)], env=env)
                )
                shutil.rmtree(dst)
                dst = work / f"prejob-{i}"
                cold.append(
                    timed(
                        [*CK_ARGS, "prejob", "--workload", "bench", "--cache-dir", str(dst)],
                        env=env,
                    )
                )
                if i < args.repeat - 1:
                    shutil.rmtree(dst)
            restored = work / f"prejob-{args.repeat - 1}"
            # (sizes may differ: Triton group files are rewritten to the new root)
            assert is_restored(pushed.snapshot_id, restored), "restore is incomplete"
            assert dir_bytes(restored)[0] == file_count, "restore is incomplete"
            for _ in range(args.noop_repeat):
                noop.append(
                    timed(
                        [*CK_ARGS, "prejob", "--workload", "bench", "--cache-dir", str(restored)],
                        env=env,
                    )
                )
                bare.append(timed([sys.executable, "-c", "pass"]))
        result = {
            "size_mb": args.size_mb,
            "files": file_count,
            "bytes": total_bytes,
            "archive_bytes": archive.stat().st_size,
            "baseline_zstd_tar_s": statistics.median(baseline),
            "prejob_cold_s": statistics.median(cold),
            "cold_ratio": statistics.median(cold) / statistics.median(baseline),
            "prejob_noop_s": statistics.median(noop),
            "python_startup_s": statistics.median(bare),
            "download_only_s": statistics.median(download),
            "local_restore_s": statistics.median(local),
            "runs": {
                "baseline": baseline,
                "cold": cold,
                "noop": noop,
                "download": download,
                "local_restore": local,
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"snapshot: {result['files']} files, {result['bytes'] / 1e6:.0f} MB "
        f"({result['archive_bytes'] / 1e6:.0f} MB compressed)"
    )
    print(f"zstd -d | tar -x (local file)   {result['baseline_zstd_tar_s']:.2f} s   1.00x")
    print(
        f"prejob, empty dir (loopback)    {result['prejob_cold_s']:.2f} s   "
        f"{result['cold_ratio']:.2f}x   (target <= 1.5x)"
    )
    print(f"  of which: archive download only (curl)   {result['download_only_s']:.2f} s")
    print(
        f"  of which: cachekeeper restore of the local archive   {result['local_restore_s']:.2f} s"
    )
    print(
        f"prejob, already restored        {result['prejob_noop_s'] * 1000:.0f} ms"
        f"   (target < 300 ms; python -c pass: {result['python_startup_s'] * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    main()
