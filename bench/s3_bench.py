"""The server's cost per node with blobs in a local dir vs in an object store (issue 13).

    .venv/bin/python bench/s3_bench.py [--size-mb 350] [--nodes 3] [--herd 200]
        [--herd-size-mb 8] [--herd-concurrency 16]

One run, on loopback: a real S3 API server (moto, ``moto_server``), and for each backend a
fresh ``cachekeeper serve`` process (``--data`` only, then ``--blob-store s3://...``).

1. Per prejob: a synthetic Inductor-like cache (bench/synthetic_cache.py) is pushed as one
   snapshot; then ``--nodes`` fresh ``cachekeeper prejob`` runs, one after another. For
   each: bytes the server sent (``/metrics``, ``cachekeeper_http_response_bytes_total``)
   and the server's CPU time (utime + stime of its process, ``/proc/<pid>/stat``), and the
   prejob's wall time. ``push_s``: the big push's wall time (its publish, with the object
   store, reads every blob back and packs the archive; bench/publish_bench.py times that
   alone).
2. A herd: ``--herd`` prejobs of a smaller snapshot (``--herd-size-mb``; the bench host
   has 2 cores) into fresh dirs, ``--herd-concurrency`` at once: errors, p50/p99 wall time
   per node, and the server's total CPU.

Prints one JSON object; ratios are between the two backends of the same run. Nothing here
asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._server import CK_ARGS, BenchServer, cpu_seconds, serve  # noqa: E402
from bench.synthetic_cache import make_synthetic_cache  # noqa: E402
from tests.helpers.moto_server import start_moto  # noqa: E402


def served_bytes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = r"^cachekeeper_http_response_bytes_total(?:{[^}]*})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, flags=re.MULTILINE))


def cost(server: BenchServer) -> tuple[float, float]:
    return cpu_seconds(server.proc.pid), served_bytes(server.url)


def ck(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CK_ARGS, *args], env=env, capture_output=True, text=True, timeout=600)


def push(env: dict[str, str], cache: Path, workload: str) -> float:
    """Push ``cache``; the push's wall time (snapshot, upload, and the publish, which with
    the object store reads every blob back and packs the archive: the push waits for it by
    ``client.push.publish_timeout_for``, not the 30 s of other requests)."""
    args = [*CK_ARGS, "push", str(cache), "--workload", workload, "--allow-unregistered", "--json"]
    start = time.perf_counter()
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"push failed: {proc.stderr}")
    return time.perf_counter() - start


def prejob(env: dict[str, str], workload: str, dest: Path) -> tuple[float, bool]:
    start = time.perf_counter()
    proc = ck(env, "prejob", "--workload", workload, "--cache-dir", str(dest), "--strict")
    return time.perf_counter() - start, proc.returncode == 0


def probe(server: BenchServer, *, times: int = 5) -> tuple[float, float]:
    """The server CPU and bytes of one ``cost()`` probe itself (its GET /metrics), averaged."""
    cpu0, sent0 = cost(server)
    for _ in range(times - 1):
        cost(server)
    cpu1, sent1 = cost(server)
    return (cpu1 - cpu0) / times, (sent1 - sent0) / times


def per_node(
    server: BenchServer, env: dict[str, str], workload: str, work: Path, nodes: int
) -> dict:
    """``nodes`` prejobs one after another into fresh dirs, measured as one interval (the
    server's CPU counts in 10 ms ticks), less the probe's own cost, per node."""
    probe_cpu, probe_sent = probe(server)
    walls = []
    cpu0, sent0 = cost(server)
    for i in range(nodes):
        wall, ok = prejob(env, workload, work / f"node-{i}")
        if not ok:
            raise RuntimeError(f"prejob {i} failed")
        walls.append(wall)
    cpu1, sent1 = cost(server)
    for i in range(nodes):
        shutil.rmtree(work / f"node-{i}")
    return {
        "nodes": nodes,
        "wall_s": statistics.mean(walls),
        "server_cpu_s": max(0.0, cpu1 - cpu0 - probe_cpu) / nodes,
        "server_sent_bytes": max(0.0, sent1 - sent0 - probe_sent) / nodes,
        "probe_cpu_s": probe_cpu,
        "probe_sent_bytes": probe_sent,
    }


def herd(
    server: BenchServer, env: dict[str, str], workload: str, work: Path, n: int, conc: int
) -> dict:
    cpu0, sent0 = cost(server)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=conc) as pool:
        results = list(pool.map(lambda i: prejob(env, workload, work / f"herd-{i}"), range(n)))
    wall = time.perf_counter() - start
    cpu1, sent1 = cost(server)
    times = sorted(t for t, _ok in results)
    shutil.rmtree(work, ignore_errors=True)
    return {
        "nodes": n,
        "concurrency": conc,
        "errors": sum(1 for _t, ok in results if not ok),
        "p50_s": times[len(times) // 2],
        "p99_s": times[min(len(times) - 1, int(len(times) * 0.99))],
        "wall_s": wall,
        "server_cpu_s": cpu1 - cpu0,
        "server_sent_bytes": sent1 - sent0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=350)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--herd", type=int, default=200)
    parser.add_argument("--herd-size-mb", type=int, default=8)
    parser.add_argument("--herd-concurrency", type=int, default=16)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="ck-s3-bench-"))
    big, small = work / "big", work / "small"
    make_synthetic_cache(big, size_mb=args.size_mb, seed=1)
    make_synthetic_cache(small, size_mb=args.herd_size_mb, seed=2)
    moto = start_moto()
    out: dict = {"size_mb": args.size_mb, "herd_size_mb": args.herd_size_mb}
    try:
        for name in ("local", "s3"):
            store = moto.new_bucket() if name == "s3" else None
            base = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKEEPER_")}
            env = {**base, **moto.env, "CACHEKEEPER_HOME": str(work / f"home-{name}")}
            blob_store = ["--blob-store", store] if store else []
            with serve(work / f"data-{name}", args=blob_store, env=env) as server:
                env["CACHEKEEPER_SERVER"] = server.url
                push_s = push(env, big, "big")
                push(env, small, "small")
                out[name] = {
                    "push_s": push_s,
                    "per_node": per_node(server, env, "big", work / f"nodes-{name}", args.nodes),
                    "herd": herd(
                        server,
                        env,
                        "small",
                        work / f"herd-{name}",
                        args.herd,
                        args.herd_concurrency,
                    ),
                }
            print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    local, s3 = out["local"], out["s3"]
    out["ratios_s3_over_local"] = {
        "per_node_server_sent_bytes": s3["per_node"]["server_sent_bytes"]
        / local["per_node"]["server_sent_bytes"],
        "per_node_server_cpu_s": s3["per_node"]["server_cpu_s"] / local["per_node"]["server_cpu_s"],
        "per_node_wall_s": s3["per_node"]["wall_s"] / local["per_node"]["wall_s"],
        "herd_server_cpu_s": s3["herd"]["server_cpu_s"] / local["herd"]["server_cpu_s"],
        "herd_p50_s": s3["herd"]["p50_s"] / local["herd"]["p50_s"],
        "herd_p99_s": s3["herd"]["p99_s"] / local["herd"]["p99_s"],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
