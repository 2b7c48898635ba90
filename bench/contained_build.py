"""A build contained as a signing agent runs it (issue 32, class 4), against the same build
uncontained, in one run: does a GPU compile work in the Landlock sandbox, and what does the
supervisor cost?

    .venv/bin/python bench/contained_build.py                         # cuda, gqa-doc-causal
    .venv/bin/python bench/contained_build.py --device cpu --workload examples/workloads/cpu-tiny.toml

Each round prewarms the workload twice into fresh cache dirs, interleaved (A: reaped only,
as ``cachekeeper prewarm`` runs; B: reaped and the key hidden, as ``agent --sign-key`` runs),
and prints one JSON line per run (status, seconds, sandbox) then the median B/A ratio. The
key is a fresh one in a folder of its own under the work dir. The CI machine has no GPU,
so the CUDA case (the NVIDIA device files under Landlock) is only proven by this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cachekeeper.builder import landlock  # noqa: E402
from cachekeeper.builder.confine import Confinement  # noqa: E402
from cachekeeper.builder.prewarm import prewarm  # noqa: E402
from cachekeeper.builder.workload import load_workload  # noqa: E402
from cachekeeper.environment.devices import select_devices  # noqa: E402
from cachekeeper.environment.fingerprint import visible_gpus  # noqa: E402
from cachekeeper.snapshot.signing import generate_keypair  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default=str(REPO / "examples/workloads/gqa-doc-causal.toml"))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--key-dir",
        default=None,
        help="where the fresh key goes (default: the work dir, under /tmp: the sandboxed"
        " builds then get a TMPDIR of their own)",
    )
    args = parser.parse_args()
    reason = landlock.unavailable_reason()
    if reason is not None:
        print(json.dumps({"error": f"no sandbox on this host: {reason}"}))
        return 1
    workload = load_workload(Path(args.workload))
    devices = select_devices(args.device, visible=visible_gpus)
    ratios = []
    with tempfile.TemporaryDirectory(prefix="ck-contained-") as tmp:
        work = Path(tmp)
        keys = Path(args.key_dir) if args.key_dir else work / "keys"
        key, _pub, _id = generate_keypair(keys / f"builder-{time.time_ns()}")
        for n in range(args.rounds):
            seconds = {}
            for label, confinement in (
                ("reaped", Confinement()),
                ("reaped+key hidden", Confinement(hidden=(key,), defined_imports=True)),
            ):
                started = time.monotonic()
                # Cache dirs in a folder of their own, beside the key's: on a GPU, a verify's
                # autotune writes .best_config files under the path its kernels were compiled
                # at (prewarm's staging dir, already removed), and Landlock admits no new
                # entry in a folder that holds the hidden key (measured on the H200).
                report = prewarm(
                    workload, work / "caches" / f"cache-{n}-{len(seconds)}", devices=devices,
                    confinement=confinement,
                )  # fmt: skip
                seconds[label] = time.monotonic() - started
                print(json.dumps({"round": n, "run": label, "status": report.status,
                                  "seconds": round(seconds[label], 2),
                                  "hidden": [str(p) for p in confinement.hidden]}))  # fmt: skip
                if report.status != "verified":
                    print(json.dumps(report.to_dict())[:4000])
                    return 1
            ratios.append(seconds["reaped+key hidden"] / seconds["reaped"])
    print(json.dumps({"median_ratio_hidden_over_reaped": round(statistics.median(ratios), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
