"""One "first training step" in a fresh process, for bench/ttfs.py.

    TTFS_SPAWN_AT=<time.time() at spawn> TORCHINDUCTOR_CACHE_DIR=DIR \
        python bench/ttfs_step.py --workload W.toml --device cuda:0 [--load-mega F] [--save-mega F]

Runs every regime of the workload exactly as prewarm does (cachekeeper.builder._child.run: the
same traced calls, forward + backward on GPU, forward only on CPU) and prints one JSON
line: seconds from the parent's spawn to the end of the step (``ttfs_s``, so interpreter
start and ``import torch`` count, as they do for a training job), the import time, the
time in torch.compiler.load_cache_artifacts for the Mega-Cache case, per-regime seconds
and the FX-graph / AOTAutograd counters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    spawn_at = float(os.environ.get("TTFS_SPAWN_AT", time.time()))
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True, type=Path)
    parser.add_argument("--device", required=True)
    parser.add_argument("--load-mega", type=Path)
    parser.add_argument("--save-mega", type=Path)
    args = parser.parse_args()

    t0 = time.time()
    import torch

    from cachekeeper.builder._child import run
    from cachekeeper.builder.workload import load_workload

    import_s = time.time() - t0
    load_s = 0.0
    if args.load_mega:
        t1 = time.time()
        torch.compiler.load_cache_artifacts(args.load_mega.read_bytes())
        load_s = time.time() - t1
    workload = load_workload(args.workload)
    result = run(workload, device=args.device, mode="verify", source=str(args.workload))
    end_at = time.time()
    saved_bytes = 0
    if args.save_mega:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is not None:
            blob, _info = artifacts
            args.save_mega.write_bytes(blob)
            saved_bytes = len(blob)
    print(
        json.dumps(
            {
                "status": result["status"],
                "error": result.get("error"),
                "ttfs_s": round(end_at - spawn_at, 3),
                "startup_s": round(t0 - spawn_at, 3),
                "import_s": round(import_s, 3),
                "mega_load_s": round(load_s, 3),
                "mega_saved_bytes": saved_bytes,
                "regimes": [
                    {"name": r["name"], "seconds": r["seconds"], "seq_seconds": r["seq_seconds"]}
                    for r in result["regimes"]
                ],
                "counters": result["counters"],
            }
        )
    )
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
