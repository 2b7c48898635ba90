"""What reading a cache dir as it was scanned costs (issue 32, class 7): the scan and the
read of every file, path-based as before against descriptor-relative (``scan.CacheTree``).

    .venv/bin/python bench/scan_read_bench.py [--size-mb 50] [--rounds 15] [--json]

A synthetic cache (bench/synthetic_cache.py; a few thousand files, warm in the page
cache after the first round) is scanned and every file read and hashed, in one process,
the two ways alternating round by round (the order swapped each round) so that machine
load weighs on both: ``paths`` is the scan of commit 3a97f40 (``os.scandir`` on each
folder's path) and ``open(path)`` per file, as push read them; ``descriptors`` is
``CacheTree.scan()`` and ``CacheTree.reading()`` per file (``O_NOFOLLOW`` opens from folder
descriptors, ``fstat`` before and after). Also the scan alone (what postjob pays). Medians
and their ratio; no target.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.synthetic_cache import make_synthetic_cache  # noqa: E402
from cachekeeper.snapshot.scan import CacheTree, is_excluded  # noqa: E402


def _scan_by_paths(root: Path) -> list[tuple[str, Path, int]]:
    """The scan as it was at 3a97f40 (cachekeeper/snapshot/scan.py), links refused the same way."""
    found: list[tuple[str, Path, int]] = []
    stack: list[tuple[Path, str]] = [(root, "")]
    while stack:
        folder, prefix = stack.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if entry.is_symlink():
                    raise RuntimeError(rel)
                is_dir = entry.is_dir(follow_symlinks=False)
                if is_excluded(entry.name, is_dir=is_dir):
                    continue
                if is_dir:
                    stack.append((Path(entry.path), rel + "/"))
                elif entry.is_file(follow_symlinks=False):
                    mode = entry.stat(follow_symlinks=False).st_mode & 0o777
                    found.append((rel, Path(entry.path), mode))
    found.sort()
    return found


def paths_scan(root: Path) -> int:
    return len(_scan_by_paths(root))


def paths_read(root: Path) -> int:
    total = 0
    for _rel, path, _mode in _scan_by_paths(root):
        total += len(hashlib.sha256(path.read_bytes()).digest())
    return total


def descriptors_scan(root: Path) -> int:
    with CacheTree(root) as tree:
        return len(tree.scan())


def descriptors_read(root: Path) -> int:
    total = 0
    with CacheTree(root) as tree:
        for scanned in tree.scan():
            with tree.reading(scanned) as fh:
                total += len(hashlib.sha256(fh.read()).digest())
    return total


CASES: dict[str, dict[str, Callable[[Path], int]]] = {
    "scan only (postjob)": {"paths": paths_scan, "descriptors": descriptors_scan},
    "scan + read + hash every file (push, snapshot)": {
        "paths": paths_read,
        "descriptors": descriptors_read,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ck-scan-bench-")) / "cache"
    make_synthetic_cache(root, size_mb=args.size_mb, seed=0)
    files = descriptors_scan(root)
    times: dict[str, dict[str, list[float]]] = {c: {"paths": [], "descriptors": []} for c in CASES}
    for case, ways in CASES.items():
        for way in ways.values():
            way(root)  # warm the page cache and the code paths
        for round_ in range(args.rounds):
            order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
            for name in order:
                started = time.perf_counter()
                ways[name](root)
                times[case][name].append(time.perf_counter() - started)
    result = {
        "files": files,
        "size_mb": args.size_mb,
        "rounds": args.rounds,
        "cases": {
            case: {
                "paths_ms": round(statistics.median(t["paths"]) * 1000, 2),
                "descriptors_ms": round(statistics.median(t["descriptors"]) * 1000, 2),
                "ratio": round(
                    statistics.median(t["descriptors"]) / statistics.median(t["paths"]), 3
                ),
            }
            for case, t in times.items()
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{files} files, {args.size_mb} MB, {args.rounds} rounds (medians)")
    for case, row in result["cases"].items():
        print(
            f"  {case:<48} paths {row['paths_ms']:8.2f} ms   descriptors"
            f" {row['descriptors_ms']:8.2f} ms   = {row['ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
