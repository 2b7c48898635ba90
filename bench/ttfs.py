"""Time to first training step on a fresh node: cold, restored through the service, local
warm, and PyTorch's Mega-Cache. The number users judge cachekeeper by.

    python bench/ttfs.py --workload examples/workloads/gqa-doc-causal.toml --device cuda:0 \
        --runs 3 --out results.json

For the workload, in fresh processes each (bench/ttfs_step.py), it measures the seconds
from spawning the process to the end of the first step (every regime, forward + backward
on GPU, forward only on CPU) for:

  cold      (a) an empty cache dir
  service   (b) `cachekeeper prejob` from a server on loopback into an empty dir, then
               the step; the prejob's own wall time is counted in
  local     (c) the original prewarmed dir in place: the floor the service can approach
  megacache (d) torch.compiler.load_cache_artifacts() of the bytes a cold run saved,
               into an empty dir, then the step (the load is counted in)

Cases are interleaved run by run so that drift on a shared machine hits all alike.
Reports medians, the ratios service/local and cold/service and service/megacache, and
the FX-graph / AOTAutograd hit and miss counts of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STEP = REPO / "bench" / "ttfs_step.py"
sys.path.insert(0, str(REPO))

from bench._server import serve  # noqa: E402  (after the path insert)

CASES = ("cold", "service", "local", "megacache")


def _ck(*args: str, env: dict[str, str], timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachekeeper", *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _step(
    workload: Path, device: str, cache_dir: Path, env: dict[str, str], *extra: str
) -> dict[str, Any]:
    run_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TTFS_SPAWN_AT": repr(time.time())}
    proc = subprocess.run(
        [sys.executable, str(STEP), "--workload", str(workload), "--device", device, *extra],
        env=run_env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"step failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1])
    if result["status"] != "ok":
        raise RuntimeError(f"step failed: {result['error']}\n{proc.stderr[-2000:]}")
    return result


def _dir_bytes(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _counts(result: dict[str, Any]) -> dict[str, int]:
    c = result["counters"]
    return {k: c.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                      "autograd_cache_hit", "autograd_cache_miss")}  # fmt: skip


def bench(
    workload: Path,
    *,
    device: str,
    runs: int,
    work: Path,
    prewarmed: Path | None = None,
    prewarm_json: Path | None = None,
) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)
    env["CACHEKEEPER_HOME"] = str(work / "home")
    name = _load_name(workload)
    mega = work / "megacache.bin"

    if prewarmed is not None and prewarm_json is not None:
        # a dir that `prewarm --json` already filled (bench/multigpu.py's cuda:0-alone run)
        print(f"[ttfs] reusing {prewarmed} (prewarmed on {device})", file=sys.stderr, flush=True)
        prewarm_report = json.loads(prewarm_json.read_text())
        prewarm_s = float(prewarm_report["seconds"])
    else:
        prewarmed = work / "prewarmed"
        print(f"[ttfs] prewarm {name} on {device}", file=sys.stderr, flush=True)
        t0 = time.time()
        proc = _ck("prewarm", str(workload), "--cache-dir", str(prewarmed), "--device", device,
                   "--json", env=env)  # fmt: skip
        prewarm_s = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(
                f"prewarm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        prewarm_report = json.loads(proc.stdout)
    cache_bytes, cache_files = _dir_bytes(prewarmed)

    with serve(work / "server", env=env, log=work / "server.log", start_timeout_s=30) as server:
        url = server.url
        _register(url, name, workload)
        proc = _ck("push", str(prewarmed), "--workload", name, "--server", url, "--json", env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"push failed:\n{proc.stdout}\n{proc.stderr}")
        push_report = json.loads(proc.stdout)

        results: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
        for run in range(runs):
            with tempfile.TemporaryDirectory(dir=work) as tmp:
                scratch = Path(tmp)
                print(f"[ttfs] run {run + 1}/{runs}: cold", file=sys.stderr, flush=True)
                extra = ("--save-mega", str(mega)) if run == 0 else ()
                results["cold"].append(_step(workload, device, scratch / "cold", env, *extra))

                print(f"[ttfs] run {run + 1}/{runs}: service", file=sys.stderr, flush=True)
                node_dir = scratch / "node"
                t0 = time.time()
                # the job runs on `device` alone: a node with more GPUs than that asks for it only
                proc = _ck("prejob", "--workload", name, "--cache-dir", str(node_dir),
                           "--device", device, "--server", url, "--strict", "--json",
                           env=env)  # fmt: skip
                prejob_s = time.time() - t0
                if proc.returncode != 0:
                    raise RuntimeError(f"prejob failed:\n{proc.stdout}\n{proc.stderr}")
                step = _step(workload, device, node_dir, env)
                step["prejob_s"] = round(prejob_s, 3)
                step["step_only_s"] = step["ttfs_s"]
                step["ttfs_s"] = round(prejob_s + step["ttfs_s"], 3)
                step["prejob"] = json.loads(proc.stdout)
                results["service"].append(step)

                print(f"[ttfs] run {run + 1}/{runs}: local", file=sys.stderr, flush=True)
                results["local"].append(_step(workload, device, prewarmed, env))

                print(f"[ttfs] run {run + 1}/{runs}: megacache", file=sys.stderr, flush=True)
                results["megacache"].append(
                    _step(workload, device, scratch / "mega", env, "--load-mega", str(mega))
                )

    med = {case: statistics.median(r["ttfs_s"] for r in rs) for case, rs in results.items()}
    return {
        "workload": name,
        "device": device,
        "runs": runs,
        "versions": _versions(),
        "prewarm_s": round(prewarm_s, 2),
        "prewarm_status": prewarm_report.get("status"),
        "prewarm_report": prewarm_report,
        "cache_bytes": cache_bytes,
        "cache_files": cache_files,
        "megacache_bytes": mega.stat().st_size if mega.exists() else 0,
        "push": push_report,
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "ratios": {
            "service_over_local": round(med["service"] / med["local"], 3),
            "cold_over_service": round(med["cold"] / med["service"], 3),
            "service_over_megacache": round(med["service"] / med["megacache"], 3),
        },
        "service_misses": [
            _counts(r)["fxgraph_cache_miss"] + _counts(r)["autograd_cache_miss"]
            for r in results["service"]
        ],
        "runs_detail": {
            case: [
                {
                    "ttfs_s": r["ttfs_s"],
                    "import_s": r["import_s"],
                    "startup_s": r["startup_s"],
                    "mega_load_s": r["mega_load_s"],
                    "prejob_s": r.get("prejob_s"),
                    "regimes": r["regimes"],
                    "counts": _counts(r),
                }
                for r in rs
            ]
            for case, rs in results.items()
        },
    }


def _load_name(workload: Path) -> str:
    from cachekeeper.builder.workload import load_workload

    return load_workload(workload).name


def _register(url: str, name: str, workload: Path) -> None:
    """Register the workload, as a site does before pushing snapshots of it."""
    import httpx

    httpx.put(f"{url}/v1/workloads/{name}", content=workload.read_text()).raise_for_status()


def _versions() -> dict[str, Any]:
    from cachekeeper.environment.fingerprint import collect

    fp = collect()
    return {k: fp.get(k) for k in ("torch", "triton", "cuda", "driver", "gpus", "python")}


def format_table(result: dict[str, Any]) -> str:
    med = result["median_s"]
    rows = [
        f"| case | median s ({result['runs']} runs) | runs | misses (fx+aot) per run |",
        "|---|---|---|---|",
    ]
    labels = {
        "cold": "(a) cold, empty dir",
        "service": "(b) prejob from server + step",
        "local": "(c) prewarmed dir in place",
        "megacache": "(d) Mega-Cache load + step",
    }
    for case in CASES:
        detail = result["runs_detail"][case]
        runs = ", ".join(f"{r['ttfs_s']:.2f}" for r in detail)
        misses = ", ".join(
            str(r["counts"]["fxgraph_cache_miss"] + r["counts"]["autograd_cache_miss"])
            for r in detail
        )
        rows.append(f"| {labels[case]} | {med[case]:.2f} | {runs} | {misses} |")
    r = result["ratios"]
    rows.append("")
    rows.append(
        f"(b)/(c) = {r['service_over_local']:.3f} (target <= 1.15), "
        f"(a)/(b) = {r['cold_over_service']:.2f}x, "
        f"(b)/(d) = {r['service_over_megacache']:.3f} (target <= 1.0)"
    )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", required=True, type=Path)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=Path, help="scratch folder (default: a new temp dir)")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    parser.add_argument(
        "--prewarmed", type=Path, help="use this already prewarmed dir instead of prewarming"
    )
    parser.add_argument(
        "--prewarm-json", type=Path, help="with --prewarmed: its `prewarm --json` report"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ck-ttfs-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = bench(
            args.workload,
            device=args.device,
            runs=args.runs,
            work=work,
            prewarmed=args.prewarmed,
            prewarm_json=args.prewarm_json,
        )
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
