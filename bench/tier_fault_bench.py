"""The per-key tier through cachekeeper's own backend: served by the tier alone, and frozen.

    python bench/tier_fault_bench.py --workload examples/workloads/gqa-doc-causal.toml \
        --device cuda:0 --runs 3 --out-dir results/    # the H200 proof, one command
    python bench/tier_fault_bench.py --device cpu --runs 2 --out-dir /tmp/tier-fault

Needs no network and no redis-py (the job's Python does not import it; the server needs
cachekeeper's server extras). One ``cachekeeper serve --resp-port`` on loopback with a
write token; nodes run ``cachekeeper prejob`` (the CLI, ``--tier-backend auto``: the
backend is checked to be cachekeeper's own) and then the first step of the workload in a
fresh process (bench/ttfs_step.py: every regime as prewarm runs it). Before the runs, one
job with an empty dir and the tier on fills the tier. Then, run by run, interleaved:

  cold          an empty dir, the tier off (``prejob --no-remote-cache``): no tier at all
  local         the filling job's dir in place: local warm, the floor
  tier          an empty dir, the tier on (no snapshot exists): served by the tier alone
  frozen-start  as ``tier``, but the server is frozen (SIGSTOP) after prejob, before the
                job: every call meets a server that accepts and never answers
  frozen-mid    as ``tier``, but the server is frozen once the job got its first value
                from the tier (the server's hit counter moved): the rest of the job meets
                a frozen tier mid-run

``--cases`` runs a subset (cold always). Reported (JSON in
``--out-dir/tier-fault-<device>.json``, a table on stdout): the median
seconds from spawn to the end of the first step (prejob counted for the tier cases), the
FX graph + AOTAutograd misses of each run, and the claims: ``tier / local`` (target:
within 10%, 0 misses) and ``frozen-* - cold`` (target: at most 3 s: a frozen tier costs a
job one deadline, then the job compiles what it did not get, as without a tier), and the
seconds each run's processes waited on the tier by the backend's own clock (``call_s``:
the tier's cost, free of the compile's noise on a loaded host). Each run's processes'
counts (the breaker's reason) are kept. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._server import serve  # noqa: E402
from bench.tier_bench import TOKEN, _metric, _prejob  # noqa: E402
from bench.ttfs import _counts, _step, _versions  # noqa: E402
from tests.helpers.ports import free_port  # noqa: E402

CASES = ("cold", "local", "tier", "frozen-start", "frozen-mid")


def _misses(step: dict[str, Any]) -> int:
    counts = _counts(step)
    return counts["fxgraph_cache_miss"] + counts["autograd_cache_miss"]


def _tier_stats(cache: Path) -> list[dict[str, Any]]:
    folder = cache / ".cachekeeper" / "tier-stats"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("tier-*.json"))]


def _freeze_on_first_hit(url: str, pid: int, hits_before: float, stop: threading.Event) -> None:
    """SIGSTOP the server once its tier-hit counter moved (polled every 20 ms)."""
    while not stop.is_set():
        try:
            if _metric(url, "cachekeeper_remote_cache_gets_total", result="hit") > hits_before:
                os.kill(pid, signal.SIGSTOP)
                return
        except Exception:  # noqa: BLE001 - a poll that failed: try again
            pass
        stop.wait(0.02)


def bench(
    workload: Path, *, device: str, runs: int, work: Path, cases: tuple[str, ...] = CASES
) -> dict[str, Any]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHINDUCTOR_", "CACHEKEEPER_")) and k != "PYTHONPATH"
    }
    env.pop("TRITON_CACHE_DIR", None)
    env["CACHEKEEPER_HOME"] = str(work / "home")
    name = "tier-fault-bench"  # no snapshot of it exists: a node is served by the tier alone
    args = ["--resp-port", str(free_port()), "--token", f"{TOKEN}:write"]
    with serve(work / "server", args=args, env=env, log=work / "server.log") as server:
        url, pid = server.url, server.proc.pid

        def node(cache: Path, *flags: str) -> tuple[float, dict[str, Any]]:
            seconds, report = _prejob(name, cache, env, url, device, *flags)
            return seconds, report

        print("[tier-fault] one job fills the tier", file=sys.stderr, flush=True)
        filled = work / "filled"
        _, report = node(filled, "--tier-timeout", "30")
        if report.get("remote_cache_backend") != "cachekeeper":
            raise RuntimeError(f"the node is not on cachekeeper's backend: {report}")
        fill = _step(workload, device, filled, {**env, **report["exports"]})
        local_exports = report["exports"]

        results: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
        for run in range(runs):
            with tempfile.TemporaryDirectory(dir=work) as tmp:
                scratch = Path(tmp)
                for case in cases:
                    print(f"[tier-fault] run {run + 1}/{runs}: {case}", file=sys.stderr,
                          flush=True)  # fmt: skip
                    cache = scratch / case
                    if case == "local":
                        results[case].append(
                            _step(workload, device, filled, {**env, **local_exports})
                        )
                        continue
                    flags = ("--no-remote-cache",) if case == "cold" else ()
                    seconds, report = node(cache, *flags)
                    stop = threading.Event()
                    watcher = None
                    hits0 = _metric(url, "cachekeeper_remote_cache_gets_total", result="hit")
                    if case == "frozen-start":
                        os.kill(pid, signal.SIGSTOP)
                    elif case == "frozen-mid":
                        watcher = threading.Thread(
                            target=_freeze_on_first_hit, args=(url, pid, hits0, stop), daemon=True
                        )
                        watcher.start()
                    try:
                        step = _step(workload, device, cache, {**env, **report["exports"]})
                    finally:
                        stop.set()
                        if watcher is not None:
                            watcher.join(5)
                        os.kill(pid, signal.SIGCONT)
                    step.update(
                        prejob_s=round(seconds, 3),
                        ttfs_s=round(seconds + step["ttfs_s"], 3),
                        backend=report.get("remote_cache_backend"),
                        tier_processes=_tier_stats(cache),
                    )
                    results[case].append(step)

    med = {case: statistics.median(r["ttfs_s"] for r in rs) for case, rs in results.items()}

    def ratio(a: str, b: str) -> float | None:
        return round(med[a] / med[b], 3) if a in med and b in med else None

    def minus(a: str, b: str) -> float | None:
        return round(med[a] - med[b], 3) if a in med and b in med else None

    return {
        "workload": str(workload),
        "device": device,
        "runs": runs,
        "versions": _versions(),
        "fill_s": fill["ttfs_s"],
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "claims": {
            "tier_over_local": ratio("tier", "local"),
            "frozen_start_minus_cold_s": minus("frozen-start", "cold"),
            "frozen_mid_minus_cold_s": minus("frozen-mid", "cold"),
            # what the job waited on the tier (every process, the backend's own clock):
            # the frozen tier's cost, free of the compile's noise
            "tier_wait_s": {
                case: [round(sum(p.get("call_s", 0.0) for p in r["tier_processes"]), 3) for r in rs]
                for case, rs in results.items()
                if case not in ("cold", "local")
            },  # fmt: skip
        },
        "misses": {case: [_misses(r) for r in rs] for case, rs in results.items()},
        "runs_detail": {
            case: [{k: v for k, v in r.items() if k != "counters"} for r in rs]
            for case, rs in results.items()
        },
    }


def format_table(result: dict[str, Any]) -> str:
    med, claims = result["median_s"], result["claims"]
    waits = claims["tier_wait_s"]
    return "\n".join(
        [
            "| case | median time to first step (s) | misses per run | waited on the tier (s) |",
            "|---|---|---|---|",
            *(f"| {c} | {med[c]} | {result['misses'][c]} | {waits.get(c, '-')} |" for c in med),
            "",
            f"tier / local {claims['tier_over_local']} (target <= 1.10, 0 misses);"
            f" frozen-start - cold {claims['frozen_start_minus_cold_s']} s,"
            f" frozen-mid - cold {claims['frozen_mid_minus_cold_s']} s (target <= 3 s)",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, default=REPO / "examples/workloads/cpu-tiny.toml")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, help="Write tier-fault-<device>.json here.")
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"A subset of {','.join(CASES)} (cold always)."
    )
    args = parser.parse_args()
    cases = tuple(c for c in CASES if c == "cold" or c in args.cases.split(","))
    with tempfile.TemporaryDirectory(prefix="tier-fault-bench-") as tmp:
        result = bench(
            args.workload, device=args.device, runs=args.runs, work=Path(tmp), cases=cases
        )
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        label = args.device.replace(":", "")
        (args.out_dir / f"tier-fault-{label}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
