"""Server CPU per GET of one large per-key tier value, with and without the hot values.

    python bench/tier_get_bench.py [--value-mb 5] [--gets 200] [--rounds 3]

One ``cachekeeper serve --resp-port`` per case (``remote_cache_memory_bytes`` 0, then the
default), a random value of ``--value-mb`` SET through redis-py, then ``--gets`` GETs of
it by redis-py alone (bench/tier_bench.py's ``_gets_cpu``: utime + stime of the server
from /proc around them; one GET first, so a hot value is in memory). Cases alternate
round by round. Issue 27's target: under 5 ms of server CPU per GET.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._server import serve  # noqa: E402
from bench.tier_bench import TOKEN, _gets_cpu, _metric, _redis_path  # noqa: E402
from cachekeeper import remote_tier  # noqa: E402
from tests.helpers.ports import free_port  # noqa: E402


def _one(work: Path, *, memory_bytes: int | None, value_mb: float, gets: int) -> dict[str, float]:
    data = work / "data"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKEEPER_")}
    env.update(_redis_path(), CK_BENCH_DATA=str(data))
    server_env = (
        {} if memory_bytes is None else {"CACHEKEEPER_REMOTE_CACHE_MEMORY_BYTES": str(memory_bytes)}
    )
    args = ["--resp-port", str(port), "--token", f"{TOKEN}:write"]
    with serve(data, args=args, env=server_env) as server:
        url = remote_tier.tier_url(server.url, port=port, token=TOKEN)
        script = (
            "import os, redis\n"
            f"r = redis.Redis.from_url({url!r})\n"
            f"r.set(b'pt2:bench::key', os.urandom({int(value_mb * 2**20)}))\n"
        )
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
        deadline = time.monotonic() + 30
        while _metric(server.url, "cachekeeper_remote_cache_keys") < 1:
            assert time.monotonic() < deadline, "the value was never stored"
            time.sleep(0.1)
        return _gets_cpu(server.url, port, server.proc.pid, env, count=gets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--value-mb", type=float, default=5.0)
    parser.add_argument("--gets", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    found: dict[str, list[float]] = {"no hot values": [], "hot values": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_no in range(args.rounds):
            for case, memory in (("no hot values", 0), ("hot values", None)):
                got = _one(Path(tmp) / f"{case}-{round_no}".replace(" ", "-"),
                           memory_bytes=memory, value_mb=args.value_mb, gets=args.gets)  # fmt: skip
                found[case].append(got["server_cpu_ms_per_get"])
    summary = {case: statistics.median(v) for case, v in found.items()}
    print(json.dumps({"value_mb": args.value_mb, "gets": args.gets, "runs": found,
                      "median_server_cpu_ms_per_get": summary}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
