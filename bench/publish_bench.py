"""The server's publish time into an object store: read back, hash, pack, upload the archive.

    .venv/bin/python bench/publish_bench.py [--size-mb 100] [--runs 2]

On loopback: a real S3 API server (moto, ``moto_server``) and ``cachekeeper serve
--blob-store s3://...`` (bench/_server.py). A synthetic Inductor-like cache
(bench/synthetic_cache.py) is uploaded once through the presigned PUTs; then each run
publishes the same blobs under a new workload name (a new snapshot id, so the server reads
every blob back, hashes it and packs and uploads a new archive) and times that one
``POST /v1/snapshots``. The first run also records a row per blob (blobs new to the
catalog); later runs find the rows. Prints one JSON object. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._server import cpu_seconds, serve  # noqa: E402
from bench.synthetic_cache import make_synthetic_cache  # noqa: E402
from cachekeeper.client.api import CacheClient  # noqa: E402
from cachekeeper.client.push import upload_missing  # noqa: E402
from cachekeeper.snapshot import snapshot_dir  # noqa: E402
from cachekeeper.store import LocalStore  # noqa: E402
from tests.helpers.moto_server import start_moto  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="ck-publish-bench-"))
    cache = work / "cache"
    make_synthetic_cache(cache, size_mb=args.size_mb, seed=1)
    moto = start_moto()
    try:
        bucket = moto.new_bucket()
        store = LocalStore(home=work / "home")
        manifest = snapshot_dir(cache, store=store, workload="w0", fingerprint={"bench": 1})
        with (
            serve(work / "server", args=["--blob-store", bucket], env=moto.env) as server,
            CacheClient(base_url=server.url, timeout_s=3600, retries=0) as client,
        ):
            start = time.perf_counter()
            upload_missing(manifest, client=client, store=store, workers=8)
            upload_s = time.perf_counter() - start
            runs = []
            for run in range(args.runs):
                again = replace(manifest, workload=f"bench-{run}")
                cpu0, start = cpu_seconds(server.proc.pid), time.perf_counter()
                answer = client.publish(again)
                wall = time.perf_counter() - start
                runs.append({"wall_s": wall, "server_cpu_s": cpu_seconds(server.proc.pid) - cpu0})
                assert answer.created, answer
        blob_bytes = sum({f.digest: f.size_bytes for f in manifest.files}.values())
        out = {
            "size_mb": args.size_mb,
            "blob_count": len(manifest.digests),
            "blob_bytes": blob_bytes,
            "upload_s": round(upload_s, 2),
            "publish": [{k: round(v, 2) for k, v in r.items()} for r in runs],
            "first_publish_mb_per_s": round(blob_bytes / 1e6 / runs[0]["wall_s"], 1),
        }
        print(json.dumps(out, indent=2))
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
