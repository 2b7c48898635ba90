"""A herd of nodes GETs one per-key tier value through an object store: what the server pays.

    python bench/tier_herd_bench.py [--nodes 1000] [--value-mb 5] [--concurrency 32]
        [--fetch 50] [--out FILE]

One real S3 API server (moto) on loopback and one ``cachekeeper serve --blob-store
s3://... --resp-port`` process with a write token. One node puts a random value of
``--value-mb`` through cachekeeper's own backend (``POST /v1/tier/puts`` -> a presigned PUT
into the store -> ``POST /v1/tier/commits``, which reads it back and checks it). Then
``--nodes`` simulated nodes, ``--concurrency`` at a time, each on a new connection as a new
node would be, ask ``GET /v1/tier/values/{key}`` with the token: the server answers 307
with a presigned GET of the store, the value's sha256 and size. ``--fetch`` of them (spread
over the herd) are the backend's own client (``_cachekeeper_tier.Client.get``): they follow
the redirect to the store without the token and check size and sha256; the others stop at
the server's answer (moto is one Python process: 1,000 x 5 MB through it would measure
moto, and the server is not in that path).

Reported: the server's CPU per GET (utime + stime of its process from /proc over the herd,
divided by the GETs), beside the same herd asking ``/healthz`` (the floor of a request
on a new connection on this host: uvicorn, the middleware, no auth, no look-up), the bytes through the server per GET (request + answer, as sent on
the wire), the value bytes through the server (0 with an object store), the client-side
latency percentiles of the server's answers, and the checked fetches. Issue 30's targets:
under 1 ms of server CPU and under 2 KB through the server per GET. Nothing asserts them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._server import cpu_seconds, serve  # noqa: E402
from tests.helpers.moto_server import start_moto  # noqa: E402
from tests.helpers.ports import free_port  # noqa: E402

TOKEN = "herd-node"
KEY = "pt2:fx-graph-v1::herd-bench-value:c1"
ENVIRONMENT = "0123456789ab"


def _backend() -> Any:
    """cachekeeper's tier backend module, loaded by path as a job's sitecustomize loads it."""
    path = REPO / "cachekeeper" / "_tier_hook" / "_cachekeeper_tier.py"
    spec = importlib.util.spec_from_file_location("_cachekeeper_tier", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _client(backend: Any, url: str, *, timeout_s: float = 30.0) -> Any:
    return backend.Client(
        url=url,
        token=TOKEN,
        environment=ENVIRONMENT,
        writes=True,
        timeout_s=timeout_s,
        stats=backend.Stats("cachekeeper"),
    )


def _ask(backend: Any, url: str, target: str | None = None) -> tuple[float, int, int, int]:
    """One node's GET of the key (or ``target``), answer only: (seconds, status, bytes
    sent, bytes got)."""
    client = _client(backend, url)
    deadline = backend.Deadline(30.0)
    target = target or "/v1/tier/values/" + quote(KEY, safe="")
    headers = {
        "User-Agent": "cachekeeper-tier",
        "Authorization": "Bearer " + TOKEN,
        "X-Cachekeeper-Environment": ENVIRONMENT,
        "Host": f"{client.host}:{client.port}",
        "Connection": "close",
    }
    conn = backend.Connection(client.scheme, client.host, client.port, deadline)
    sent = len(
        (
            "\r\n".join(
                [
                    f"GET {target} HTTP/1.1",
                    *(f"{k}: {v}" for k, v in headers.items()),
                    "Content-Length: 0",
                ]
            )
            + "\r\n\r\n"
        ).encode()  # fmt: skip
    )
    started = time.perf_counter()
    try:
        status, found, body, _ = conn.request("GET", target, headers, b"", deadline)
    finally:
        conn.close()
    seconds = time.perf_counter() - started
    got = len(f"HTTP/1.1 {status} X\r\n".encode()) + sum(
        len(k) + len(v) + 4 for k, v in found.items()
    )
    return seconds, status, sent, got + 2 + len(body)


def _fetch(backend: Any, url: str, digest: str) -> tuple[float, bool]:
    """One node through the backend's own GET: the redirect followed and checked."""
    started = time.perf_counter()
    value = _client(backend, url).get(KEY)
    return time.perf_counter() - started, value is not None and hashlib.sha256(
        value
    ).hexdigest() == digest


def bench(
    *, nodes: int, value_mb: float, concurrency: int, fetch: int, work: Path
) -> dict[str, Any]:
    backend = _backend()
    moto = start_moto()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKEEPER_")}
        env.update(moto.env, CACHEKEEPER_HOME=str(work / "home"))
        args = [
            "--blob-store", moto.new_bucket(), "--resp-port", str(free_port()),
            "--token", f"{TOKEN}:write",
        ]  # fmt: skip
        with serve(work / "data", args=args, env=env, log=work / "server.log") as server:
            value = os.urandom(int(value_mb * (1 << 20)))
            digest = hashlib.sha256(value).hexdigest()
            put = _client(backend, server.url).put(KEY, value)
            if put != "stored":
                raise RuntimeError(f"the value was not stored: {put}")
            _ask(backend, server.url)  # one GET first: the presigned URL is signed once here
            every = max(1, nodes // fetch) if fetch else nodes + 1
            cpu0 = cpu_seconds(server.proc.pid)
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                answers = list(pool.map(lambda _: _ask(backend, server.url), range(nodes)))
            herd_s = time.perf_counter() - started
            cpu = cpu_seconds(server.proc.pid) - cpu0
            # The floor on this host: the same herd asking /healthz (no auth, no look-up),
            # each on a new connection too.
            cpu0 = cpu_seconds(server.proc.pid)
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda _: _ask(backend, server.url, "/healthz"), range(nodes)))
            floor = cpu_seconds(server.proc.pid) - cpu0
            with concurrent.futures.ThreadPoolExecutor(min(concurrency, 8)) as pool:
                fetched = list(
                    pool.map(lambda _: _fetch(backend, server.url, digest), range(0, nodes, every))
                )
    finally:
        moto.stop()
    latencies = sorted(a[0] for a in answers)
    statuses: dict[int, int] = {}
    for a in answers:
        statuses[a[1]] = statuses.get(a[1], 0) + 1
    through = [a[2] + a[3] for a in answers]
    return {
        "nodes": nodes,
        "value_bytes": len(value),
        "concurrency": concurrency,
        "statuses": statuses,
        "server_cpu_s": round(cpu, 4),
        "server_cpu_ms_per_get": round(1000 * cpu / nodes, 4),
        "server_cpu_ms_per_healthz": round(1000 * floor / nodes, 4),
        "bytes_through_server_per_get": round(statistics.mean(through), 1),
        "value_bytes_through_server": sum(a[3] for a in answers if a[1] == 200),
        "herd_wall_s": round(herd_s, 3),
        "answer_ms": {
            "p50": round(1000 * latencies[len(latencies) // 2], 3),
            "p99": round(1000 * latencies[int(len(latencies) * 0.99) - 1], 3),
        },
        "fetched": {
            "nodes": len(fetched),
            "checked_ok": sum(ok for _s, ok in fetched),
            "median_s": round(statistics.median(s for s, _ok in fetched), 3) if fetched else None,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--value-mb", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--fetch", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tier-herd-") as tmp:
        result = bench(
            nodes=args.nodes,
            value_mb=args.value_mb,
            concurrency=args.concurrency,
            fetch=args.fetch,
            work=Path(tmp),
        )
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
