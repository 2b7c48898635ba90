"""How long ``/healthz``, list and resolve take while N blob uploads stall (issue 18.4).

    .venv/bin/python bench/stalled_uploads.py [--stalls 100] [--probes 50]

Starts ``cachekeeper serve`` in its own process on a fresh data dir (body timeout 600 s, so
the stalls stay open for the whole run), publishes one small snapshot, then measures the
latency of ``GET /healthz``, ``GET /v1/snapshots`` and ``POST /v1/resolve`` (sequential
probes, one client) twice: with no other traffic, and while N raw connections each hold a
blob upload open after sending its headers and 10 bytes. Target: /healthz under 1 s with
100 stalls. A probe that gets no answer within 10 s counts as 10 s (``timeouts`` says how
many). Prints one JSON object; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._server import serve  # noqa: E402

FINGERPRINT = {"schema": 1, "torch": "2.13.0+cpu", "driver": None, "gpus": [], "env": {}}
PROBE_TIMEOUT_S = 10.0


def _publish(c: httpx.Client) -> None:
    data = b"stalled-uploads bench"
    digest = hashlib.sha256(data).hexdigest()
    c.put(f"/v1/blobs/{digest}", content=data).raise_for_status()
    manifest = {
        "format": 1,
        "workload": "bench",
        "fingerprint": FINGERPRINT,
        "devices": ["cpu"],
        "files": [{"path": "a.bin", "digest": digest, "size_bytes": len(data), "mode": 420}],
    }
    c.post("/v1/snapshots", json=manifest).raise_for_status()


def _probe(c: httpx.Client, probes: int) -> dict[str, object]:
    out: dict[str, object] = {}
    calls = {
        "healthz": lambda: c.get("/healthz"),
        "list": lambda: c.get("/v1/snapshots"),
        "resolve": lambda: c.post(
            "/v1/resolve", json={"fingerprint": FINGERPRINT, "workload": "bench"}
        ),
    }
    for name, call in calls.items():
        times, timeouts = [], 0
        for _ in range(probes):
            started = time.perf_counter()
            try:
                call().raise_for_status()
                times.append(time.perf_counter() - started)
            except httpx.TimeoutException:
                times.append(PROBE_TIMEOUT_S)
                timeouts += 1
        times.sort()
        out[name] = {
            "p50_ms": round(statistics.median(times) * 1000, 1),
            "max_ms": round(times[-1] * 1000, 1),
            "timeouts": timeouts,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stalls", type=int, default=100)
    parser.add_argument("--probes", type=int, default=50)
    args = parser.parse_args()
    env = {"CACHEKEEPER_LOG_LEVEL": "warning", "CACHEKEEPER_BODY_TIMEOUT_S": "600"}
    with (
        tempfile.TemporaryDirectory(prefix="ck-stalls-") as tmp,
        serve(Path(tmp) / "data", env=env) as server,
    ):
        stalled: list[socket.socket] = []
        try:
            with httpx.Client(base_url=server.url, timeout=PROBE_TIMEOUT_S) as c:
                _publish(c)
                quiet = _probe(c, args.probes)
                for i in range(args.stalls):
                    sock = socket.create_connection(("127.0.0.1", server.port))
                    sock.sendall(
                        f"PUT /v1/blobs/{i:064x} HTTP/1.1\r\nHost: b\r\n"
                        f"Content-Length: 1000000\r\n\r\n0123456789".encode()
                    )
                    stalled.append(sock)
                time.sleep(2.0)  # let the server take every stalled upload in
                loaded = _probe(c, args.probes)
        finally:
            for sock in stalled:
                sock.close()
    report = {"stalls": args.stalls, "probes": args.probes, "quiet": quiet, "stalled": loaded}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
