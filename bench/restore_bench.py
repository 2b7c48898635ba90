"""Restore benchmark: cachekeeper's verified restore against ``zstd -d | tar -x``.

    .venv/bin/python bench/restore_bench.py [--size-mb 350] [--runs 3] [--work DIR]

Builds a synthetic Inductor-like cache (bench/synthetic_cache.py) and its one-file
archive once, then, alternating in one run, times restoring the archive into an empty dir
with ``cachekeeper.restore.restore_archive`` (every byte hashed and checked, files
flushed to disk, atomic appearance) and with ``zstd -q -d -c ARCHIVE | tar -x -C DIR``
(no verification, no fsync). Prints the medians and their ratio; the target is <= 1.5x.
Before each timed run, ``os.sync()`` flushes what the previous one left dirty, so runs
do not pay for each other's writeback. Needs the ``zstd`` CLI (``apt-get install zstd``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic_cache import make_synthetic_cache  # noqa: E402

from cachekeeper.restore import restore_archive  # noqa: E402
from cachekeeper.snapshot.make import snapshot_dir, write_archive  # noqa: E402
from cachekeeper.store import LocalStore  # noqa: E402


def _time_baseline(archive: Path, dest: Path) -> float:
    dest.mkdir()
    os.sync()
    start = time.perf_counter()
    subprocess.run(f"zstd -q -d -c '{archive}' | tar -x -C '{dest}'", shell=True, check=True)
    return time.perf_counter() - start


def _time_baseline_synced(archive: Path, dest: Path) -> float:
    """The same extraction made durable (``sync`` after), as cachekeeper's restore is."""
    dest.mkdir()
    os.sync()
    start = time.perf_counter()
    subprocess.run(
        f"zstd -q -d -c '{archive}' | tar -x -C '{dest}' && sync", shell=True, check=True
    )
    return time.perf_counter() - start


def _time_cachekeeper(archive: Path, dest: Path) -> float:
    os.sync()
    start = time.perf_counter()
    report = restore_archive(archive, dest)
    elapsed = time.perf_counter() - start
    assert report.conflicts == [] and report.written > 0, report
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=350)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    args = parser.parse_args()
    if shutil.which("zstd") is None:
        sys.exit("the zstd CLI is missing: apt-get install zstd")
    work = Path(args.work or tempfile.mkdtemp(prefix="ck-restore-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src, archive = work / "src", work / "cache.tar.zst"
    if not src.exists():
        make_synthetic_cache(src, size_mb=args.size_mb)
    store = LocalStore(home=work / "home")
    start = time.perf_counter()
    manifest = snapshot_dir(src, store=store, fingerprint={"bench": True}, devices=["cpu"])
    snap_s = time.perf_counter() - start
    start = time.perf_counter()
    archive_bytes = write_archive(manifest, store.blobs, archive)
    archive_s = time.perf_counter() - start
    print(
        f"cache: {len(manifest.files)} files, {manifest.size_bytes / 1e6:.1f} MB; "
        f"archive {archive_bytes / 1e6:.1f} MB; snapshot {snap_s:.2f} s, archive {archive_s:.2f} s"
    )
    ours: list[float] = []
    base: list[float] = []
    synced: list[float] = []
    for i in range(args.runs):
        for name, timer, out in (
            ("tar", _time_baseline, base),
            ("cachekeeper", _time_cachekeeper, ours),
            ("tar+sync", _time_baseline_synced, synced),
        ):
            dest = work / f"dest-{name.replace('+', '-')}-{i}"
            out.append(timer(archive, dest))
            shutil.rmtree(dest)
            print(f"run {i + 1} {name}: {out[-1]:.2f} s")
    ours_s, base_s = statistics.median(ours), statistics.median(base)
    synced_s = statistics.median(synced)
    print(
        f"median: cachekeeper {ours_s:.2f} s, zstd|tar {base_s:.2f} s, ratio {ours_s / base_s:.2f}x; "
        f"zstd|tar + sync {synced_s:.2f} s, ratio {ours_s / synced_s:.2f}x"
    )
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
