"""What the job reports cost the hooks: prejob's no-op path with and without its report,
and postjob on the same dir (a fresh process each time, on loopback).

    .venv/bin/python bench/postjob_bench.py [--size-mb 50] [--repeat 15]

A synthetic cache (bench/synthetic_cache.py) is pushed to ``cachekeeper serve`` on loopback
(bench/_server.py) and restored by ``cachekeeper prejob``. Then, alternating
so that machine load hits every case alike, it times: ``prejob --no-report`` (the no-op
path as it was), ``prejob`` (the no-op path plus its report), and ``postjob`` (diff plus
report; the first run records what it counted, so the later ones count nothing new, as on
a node whose jobs all hit). Medians; ``python -c pass`` for scale. Ratios, no targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._server import CK_ARGS, serve  # noqa: E402  (after the path insert)
from bench.prejob_bench import timed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from bench.synthetic_cache import make_synthetic_cache
    from cachekeeper.client.api import CacheClient
    from cachekeeper.client.push import push

    work = Path(tempfile.mkdtemp(prefix="ck-postjob-bench-"))
    src, cache = work / "src", work / "cache"
    make_synthetic_cache(src, size_mb=args.size_mb, seed=0)
    with serve(work / "server") as server:
        with CacheClient(base_url=server.url) as client:
            push(src, client=client, workload="bench")
        env = {**os.environ, "CACHEKEEPER_SERVER": server.url, "CACHEKEEPER_HOME": str(work)}
        env.pop("CACHEKEEPER_TOKEN", None)
        hook = ["--workload", "bench", "--cache-dir", str(cache)]
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "prejob --no-report (no-op)": [*CK_ARGS, "prejob", *hook, "--no-report"],
            "prejob (no-op + report)": [*CK_ARGS, "prejob", *hook],
            "postjob (nothing new)": [*CK_ARGS, "postjob", *hook],
        }
        timed(cases["prejob (no-op + report)"], env=env)  # the restore itself
        timed(cases["postjob (nothing new)"], env=env)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeat):
            for name, cmd in cases.items():
                times[name].append(timed(cmd, env=env))
        medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["prejob --no-report (no-op)"]
    if args.json:
        print(json.dumps({"median_s": medians, "repeat": args.repeat}, indent=2))
        return
    print(f"{'case':<30}{'median ms':>10}{'x no-op':>9}   ({args.repeat} runs, {time.ctime()})")
    for name, value in medians.items():
        print(f"{name:<30}{value * 1000:>10.0f}{value / base:>9.2f}")


if __name__ == "__main__":
    main()
