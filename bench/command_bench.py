"""A real framework's job as a command workload: cold, through the service, and local warm.

    python bench/command_bench.py --out DIR [--rounds 3] [--nproc 1] [--device cuda] \
        [-- PROGRAM ARGS]            # passed to bench/programs/hf_llama_train.py

Issue 23's proof. The job is ``torchrun --nproc-per-node N --standalone
bench/programs/hf_llama_train.py`` (HF transformers Llama, flex_attention, the whole model
compiled with ``torch.compile``). The bench starts a server on loopback, registers the job
as a ``[[command]]`` workload, and lets ``cachekeeper agent --once --allow TORCHRUN`` build
it (the prewarm's cost: one cold run of the command plus one warm verify run in a fresh
copy, then the push). Then, round by round, interleaved:

- **cold**: the job on an empty ``TORCHINDUCTOR_CACHE_DIR``;
- **service**: ``cachekeeper prejob`` (a fresh process: fingerprint, resolve, download,
  verified restore) into an empty dir, then the job there; its wall time is added;
- **local**: the job on the dir the first cold run compiled into, in place (a machine that
  compiled before: the floor).

A job's time is its own: from its process start (``/proc``; interpreter start and imports
count) to the end of its last step, the slowest rank's. Each run's misses are the ranks'
own counters. Writes ``DIR/command-bench.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._server import CK_ARGS, cpu_seconds, serve  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROGRAM = REPO / "bench" / "programs" / "hf_llama_train.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
WORKLOAD = "hf-llama"


def _argv(nproc: int, program_args: list[str]) -> list[str]:
    return [TORCHRUN, "--nproc-per-node", str(nproc), "--standalone", str(PROGRAM), *program_args]


def _toml(argv: list[str]) -> str:
    return f'name = "{WORKLOAD}"\n[[command]]\nargv = {json.dumps(argv)}\ntimeout = "20m"\n'


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CACHEKEEPER_") and k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCH_TRACE")
    }
    env.update(extra)
    return env


def _job(argv: list[str], cache_dir: Path, report: Path, nproc: int) -> dict[str, Any]:
    """One run of the job; its ranks' reports and the slowest rank's end time."""
    report.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    proc = subprocess.run(
        [*argv, "--report", str(report)],
        env=_env(TORCHINDUCTOR_CACHE_DIR=str(cache_dir)),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    ranks = [
        json.loads(report.with_name(f"{report.stem}-rank{r}{report.suffix}").read_text())
        for r in range(nproc)
    ]
    misses = sum(
        r["counters"]["fxgraph_cache_miss"] + r["counters"]["autograd_cache_miss"] for r in ranks
    )
    return {
        "wall_s": round(wall, 3),
        "end_s": max(r["end_s"] for r in ranks),
        "first_step_s": max(r["steps_end_s"][0] for r in ranks),
        "misses": misses,
        "ranks": ranks,
    }


def _ck(*args: str, timeout: float = 3600) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [*CK_ARGS, *args], env=_env(), capture_output=True, text=True, timeout=timeout
    )
    return proc, time.monotonic() - started


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("program_args", nargs="*", help="after --: the program's options")
    args = parser.parse_args()
    out: Path = args.out.absolute()
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    argv = _argv(args.nproc, list(args.program_args))
    results: dict[str, Any] = {"argv": argv, "rounds": args.rounds, "nproc": args.nproc}
    with serve(work / "data", log=out / "server.log") as server:
        httpx.put(
            f"{server.url}/v1/workloads/{WORKLOAD}", content=_toml(argv), timeout=30
        ).raise_for_status()
        agent, agent_s = _ck(
            "agent", "--server", server.url, "--once", "--json",
            "--work-dir", str(work / "agent"), "--allow", TORCHRUN,
        )  # fmt: skip
        (out / "agent.log").write_text(agent.stderr)
        if agent.returncode != 0:
            raise SystemExit(f"agent --once failed:\n{agent.stderr[-4000:]}")
        (outcome,) = json.loads(agent.stdout.strip().splitlines()[-1])["outcomes"]
        if outcome["status"] != "built":
            raise SystemExit(
                f"the agent did not build it: {outcome['status']}: {outcome['detail']}"
            )
        prewarm = outcome["prewarm"]
        (cold_run,) = prewarm["commands"]
        (verify_run,) = prewarm["verify"]["commands"]
        results["prewarm"] = {
            "agent_wall_s": round(agent_s, 3),
            "cold_run_s": cold_run["seconds"],
            "verify_run_s": verify_run["seconds"],
            "prewarm_s": prewarm["seconds"],
            "cold_ranks": [
                {"rank": p["rank"], "device": p["device"], "counters": p["counters"]}
                for p in cold_run["processes"]
                if p["compiled"]
            ],
            "verify_ranks": [
                {"rank": p["rank"], "device": p["device"], "counters": p["counters"]}
                for p in verify_run["processes"]
                if p["compiled"]
            ],
            "snapshot_id": outcome["snapshot_id"],
        }
        cases: dict[str, list[dict[str, Any]]] = {"cold": [], "service": [], "local": []}
        results["cases"] = cases
        (out / "command-bench.json").write_text(json.dumps(results, indent=2))  # so far
        local = work / "local"
        for round_no in range(args.rounds):
            cold_dir = local if round_no == 0 else work / f"cold-{round_no}"
            cases["cold"].append(
                _job(argv, cold_dir, work / f"r{round_no}" / "cold.json", args.nproc)
            )
            node = work / f"node-{round_no}"
            cpu_before = cpu_seconds(server.proc.pid)
            prejob, prejob_s = _ck("prejob", "--workload", WORKLOAD, "--server", server.url,
                                   "--cache-dir", str(node / "inductor"))  # fmt: skip
            if prejob.returncode != 0 or "restored snapshot" not in prejob.stderr:
                raise SystemExit(f"prejob did not restore:\n{prejob.stderr[-3000:]}")
            run = _job(argv, node / "inductor", work / f"r{round_no}" / "service.json", args.nproc)
            run["prejob_s"] = round(prejob_s, 3)
            run["server_cpu_s"] = round(cpu_seconds(server.proc.pid) - cpu_before, 3)
            run["total_s"] = round(prejob_s + run["end_s"], 3)
            cases["service"].append(run)
            cases["local"].append(
                _job(argv, local, work / f"r{round_no}" / "local.json", args.nproc)
            )
            (out / "command-bench.json").write_text(json.dumps(results, indent=2))  # so far
            print(
                f"round {round_no}: cold {cases['cold'][-1]['end_s']:.1f} s, service"
                f" {run['total_s']:.1f} s (prejob {prejob_s:.2f} s), local"
                f" {cases['local'][-1]['end_s']:.1f} s",
                file=sys.stderr,
            )
    cold = _median([r["end_s"] for r in cases["cold"][1:] or cases["cold"]])
    service = _median([r["total_s"] for r in cases["service"]])
    service_job = _median([r["end_s"] for r in cases["service"]])
    prejob_med = _median([r["prejob_s"] for r in cases["service"]])
    local_med = _median([r["end_s"] for r in cases["local"]])
    results["summary"] = {
        "cold_end_s": cold,
        "service_total_s": service,
        "service_job_s": service_job,
        "prejob_s": prejob_med,
        "local_end_s": local_med,
        "service_over_local": round(service / local_med, 3),
        "service_job_over_local": round(service_job / local_med, 3),
        "misses": {case: [r["misses"] for r in runs] for case, runs in cases.items()},
    }
    (out / "command-bench.json").write_text(json.dumps(results, indent=2))
    s = results["summary"]
    p = results["prewarm"]
    print(f"| case | to the end of the steps (median of {args.rounds}) | misses per run |")
    print("|---|---|---|")
    print(f"| cold (empty dir) | {cold:.1f} s | {s['misses']['cold']} |")
    print(
        f"| service (prejob + job) | {service:.1f} s (prejob {prejob_med:.2f} s, job"
        f" {service_job:.1f} s) | {s['misses']['service']} |"
    )
    print(f"| local warm (same dir) | {local_med:.1f} s | {s['misses']['local']} |")
    print(
        f"\nservice / local = {s['service_over_local']:.3f} (job alone"
        f" {s['service_job_over_local']:.3f}); prewarm: cold run {p['cold_run_s']:.1f} s +"
        f" verify run {p['verify_run_s']:.1f} s (agent round {p['agent_wall_s']:.1f} s)"
    )


if __name__ == "__main__":
    main()
