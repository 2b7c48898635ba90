"""How long collecting the fingerprint takes (the pre-job hook pays it on every job).

    python bench/fingerprint_bench.py [--runs 10]

Reports the median of in-process ``collect()`` calls (first call separately: it pays the
imports) and of fresh ``python -m cachekeeper fingerprint --json`` processes against a bare
``python -c pass`` in the same run. Target: well under 300 ms on a node with torch installed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()

    t0 = time.perf_counter()
    from cachekeeper.fingerprint import collect

    collect()
    first_ms = (time.perf_counter() - t0) * 1000
    calls = []
    for _ in range(args.runs):
        t1 = time.perf_counter()
        collect()
        calls.append((time.perf_counter() - t1) * 1000)
    bare = [_wall([sys.executable, "-c", "pass"]) * 1000 for _ in range(args.runs)]
    cli = [
        _wall([sys.executable, "-m", "cachekeeper", "fingerprint", "--json"]) * 1000
        for _ in range(args.runs)
    ]
    torch_there = "torch" in collect() and collect()["torch"] is not None
    print(f"torch installed: {torch_there} ({collect()['torch']})")
    print(f"first collect() incl. imports: {first_ms:.1f} ms")
    print(f"collect() median of {args.runs}: {statistics.median(calls):.1f} ms")
    print(f"`python -c pass` median: {statistics.median(bare):.1f} ms")
    print(f"`python -m cachekeeper fingerprint --json` median: {statistics.median(cli):.1f} ms")
    print(
        f"fingerprint process minus bare interpreter: {statistics.median(cli) - statistics.median(bare):.1f} ms"
    )


if __name__ == "__main__":
    main()
