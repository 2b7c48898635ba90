"""A/B of the hook's no-op path and the local restore, one call of each install in turn.

    python bench/interleaved_ab.py --site old=/tmp/site-old --site new=/tmp/site-new \
        [--size-mb 50] [--runs 20] [--json]

``bench/ab_versions.py`` times each install's commands of a round in a block; on a host
that other work loads in bursts a block can land in a burst, and a median moves by 20 %
either way (docs/benchmarks.md, issue 26). Here the installs (``bench.ab_versions.Install``:
each its own ``cachekeeper serve`` on loopback holding the same synthetic snapshot, restored
once into its own dir, and its own one-file snapshot of it) alternate call by call, the
order swapped every run, so a burst weighs on both: per run, each install does one no-op
``prejob`` on its restored dir and one ``restore ARCHIVE`` into an empty dir.

Printed per install and case: the median and the minimum wall time, the median CPU time
of the command's process (user + system: waiting for a CPU adds nothing to it), and each
median's ratio to the first install's.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.ab_versions import Install  # noqa: E402
from bench.synthetic_cache import make_synthetic_cache  # noqa: E402

CASES = ("prejob_noop", "restore_local")


def _timed(install: Install, *args: str) -> tuple[float, float]:
    """(wall s, CPU s) of one command of ``install``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = install.timed(*args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--size-mb", type=int, default=50)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ck-interleaved-ab-"))
    installs: list[Install] = []
    wall: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    try:
        make_synthetic_cache(work / "src", size_mb=args.size_mb, seed=0)
        for spec in args.site:
            name, _, site = spec.partition("=")
            installs.append(Install(name, Path(site).resolve(), work))
            wall[name] = {c: [] for c in CASES}
            cpu[name] = {c: [] for c in CASES}
        for install in installs:
            install.start(work / "src")  # ends with a prejob into its warm/ dir
        for run in range(args.runs):
            for install in installs if run % 2 == 0 else installs[::-1]:
                prejob = ["prejob", "--workload", "bench", "--server", install.url]
                fresh = install.work / f"restore-{run}"
                archive = str(install.work / "snap.tar.zst")
                for case, command in (
                    ("prejob_noop", [*prejob, "--cache-dir", str(install.work / "warm")]),
                    ("restore_local", ["restore", archive, "--cache-dir", str(fresh)]),
                ):
                    took, used = _timed(install, *command)
                    wall[install.name][case].append(took)
                    cpu[install.name][case].append(used)
                shutil.rmtree(fresh)
    finally:
        for install in installs:
            install.stop()
        shutil.rmtree(work, ignore_errors=True)

    first = installs[0].name
    med = {n: {c: statistics.median(v) for c, v in t.items()} for n, t in wall.items()}
    cpu_med = {n: {c: statistics.median(v) for c, v in t.items()} for n, t in cpu.items()}
    if args.json:
        result = {"size_mb": args.size_mb, "runs": args.runs, "medians": med}
        print(json.dumps({**result, "cpu_medians": cpu_med, "wall": wall, "cpu": cpu}, indent=2))
        return
    print(f"{args.size_mb} MB synthetic cache, {args.runs} runs, alternating call by call")
    for case in CASES:
        for name in wall:
            w, c = med[name][case], cpu_med[name][case]
            print(
                f"{case:14} {name:6} wall median {w * 1000:7.1f} ms ({w / med[first][case]:.2f}x)"
                f"  min {min(wall[name][case]) * 1000:7.1f} ms"
                f"   cpu median {c * 1000:7.1f} ms ({c / cpu_med[first][case]:.2f}x)"
            )


if __name__ == "__main__":
    main()
