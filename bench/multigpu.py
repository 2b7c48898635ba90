"""Multi-GPU prewarm on one host (issue 14, items 1-4; issue 19's mechanism on two GPUs).

    python bench/multigpu.py --workload examples/workloads/gqa-doc-causal.toml \
        --workload examples/workloads/drafter.toml --agent-workload gqa-doc-causal \
        --raw OUT_DIR [--work DIR] [--deadline-s 560]

Run it from outside the checkout (``python -m cachekeeper`` must import the installed
package). Every command it runs is the real CLI in a fresh process; each one's stdout,
stderr, exit code and wall time land in ``OUT_DIR`` (``NN-label.{out,err,json}``), and
``OUT_DIR/summary.json`` holds the numbers. Per workload:

1. ``prewarm --device cuda:0`` (one GPU alone), ``prewarm --device cuda`` (every GPU at
   once), and, for the first workload, ``prewarm --device cuda:1`` alone: wall time per
   index and in total, cache size per index and merged, with the dedup between indices
   (bytes of identical content) and the snapshot archive size.
2. The index-0 cache verified on ``cuda:1`` (a copy: a verify adds what it compiles):
   exit 1 with the reason naming the index; ``explain`` of its snapshot (exit 1) and
   ``prejob`` from a server holding only it (a cold start whose stderr says why), then
   ``prejob --device cuda:0`` (restored: one visible GPU per rank needs only cuda:0);
   the ``cuda:1``-alone snapshot covers exactly ``["cuda:1"]``; ``GET /v1/status`` with
   ``?devices=cuda:0-7`` (what a site with 8-GPU nodes would see).

Then, for the ``--agent-workload``s:

3. ``agent --device cuda --once`` against a fresh server: one round, one verified snapshot
   per workload covering every GPU.
4. Two ranks, one process per GPU (each on its own ``cuda:N``, every GPU visible), start
   at the same moment: ``prejob`` into one shared cache dir, then the first step
   (bench/ttfs_step.py). The server's ``cachekeeper_archive_requests_total`` before and
   after counts the downloads; each rank's FX/AOT counters count its misses.

Steps are skipped, and the summary says so, once less than their estimate is left of
``--deadline-s``. CPU smoke test: ``CACHEKEEPER_TEST_FAKE_CUDA=1`` plus
``CACHEKEEPER_FINGERPRINT_OVERRIDES`` with two GPUs, and examples/workloads/cpu-tiny.toml.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
STEP = REPO / "bench" / "ttfs_step.py"
sys.path.insert(0, str(REPO))

from bench._server import serve  # noqa: E402  (after the path insert)


class Driver:
    """Runs commands, keeps every raw output, and the summary."""

    def __init__(self, *, raw: Path, work: Path, deadline_s: float) -> None:
        self.raw, self.work = raw, work
        self.deadline = time.monotonic() + deadline_s
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
        }
        self.env["CACHEKEEPER_HOME"] = str(work / "home")
        self.env["PYTHONUNBUFFERED"] = "1"
        self.count = 0
        self.summary: dict[str, Any] = {"skipped": [], "commands": []}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def enough(self, label: str, estimate_s: float) -> bool:
        if self.left() >= estimate_s:
            return True
        self.summary["skipped"].append(
            f"{label} (needs ~{estimate_s:.0f} s, {self.left():.0f} left)"
        )
        print(f"[multigpu] skip {label}: {self.left():.0f} s left", file=sys.stderr, flush=True)
        return False

    def ck(self, label: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        """``python -m cachekeeper ARGS``; its outputs saved as ``NN-label.out/.err``."""
        return self.run(label, [sys.executable, "-m", "cachekeeper", *args], env=env)

    def run(
        self, label: str, command: list[str], *, env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        self.count += 1
        stem = f"{self.count:02d}-{label}"
        print(
            f"[multigpu] {stem}: {' '.join(command[2:] if command[1] == '-m' else command)}",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.monotonic()
        proc = subprocess.run(command, env=env or self.env, cwd=self.work, capture_output=True,
                              text=True, timeout=max(30.0, self.left()))  # fmt: skip
        wall = round(time.monotonic() - t0, 3)
        (self.raw / f"{stem}.out").write_text(proc.stdout)
        (self.raw / f"{stem}.err").write_text(proc.stderr)
        record = {"label": stem, "command": command, "rc": proc.returncode, "wall_s": wall}
        self.summary["commands"].append(record)
        print(f"[multigpu]   rc={proc.returncode} in {wall:.1f} s", file=sys.stderr, flush=True)
        return {**record, "stdout": proc.stdout, "stderr": proc.stderr}

    def save(self) -> None:
        (self.raw / "summary.json").write_text(json.dumps(self.summary, indent=2))


def dir_stats(root: Path) -> dict[str, Any]:
    """Bytes and files of ``root``; per GPU index under triton/; unique content bytes."""
    sizes: dict[str, int] = {}
    by_digest: dict[str, int] = {}
    per_index: dict[str, int] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        rel = path.relative_to(root)
        if rel.parts[0] == ".cachekeeper":
            continue
        size = path.stat().st_size
        sizes[str(rel)] = size
        by_digest[hashlib.sha256(path.read_bytes()).hexdigest()] = size
        if rel.parts[0] == "triton" and len(rel.parts) > 1:
            per_index[rel.parts[1]] = per_index.get(rel.parts[1], 0) + size
    return {
        "bytes": sum(sizes.values()),
        "files": len(sizes),
        "unique_content_bytes": sum(by_digest.values()),
        "triton_bytes_per_index": per_index,
    }


class Server:
    """``cachekeeper serve`` on loopback for the driver's steps (log: ``server-NAME.log``)."""

    def __init__(self, driver: Driver, name: str) -> None:
        self._stack = ExitStack()
        served = self._stack.enter_context(
            serve(driver.work / f"server-{name}", env=driver.env, cwd=driver.work,
                  log=driver.raw / f"server-{name}.log", start_timeout_s=30)
        )  # fmt: skip
        self.url = served.url

    def register(self, workload: Path, name: str) -> None:
        httpx.put(
            f"{self.url}/v1/workloads/{name}", content=workload.read_text()
        ).raise_for_status()

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.url}{path}", timeout=30)
        response.raise_for_status()
        return (
            response.json() if "json" in response.headers.get("content-type", "") else response.text
        )

    def archive_requests(self) -> float:
        for line in self.get("/metrics").splitlines():
            if line.startswith("cachekeeper_archive_requests_total"):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        self._stack.close()


def workload_name(path: Path) -> str:
    from cachekeeper.builder.workload import load_workload

    return load_workload(path).name


def report_of(result: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return json.loads(result["stdout"])
    except ValueError:
        return None


def prewarms(d: Driver, workload: Path, name: str, *, index1_alone: bool) -> dict[str, Any]:
    """Item 1: cuda:0 alone, every GPU at once, (cuda:1 alone); sizes and dedup."""
    out: dict[str, Any] = {}
    for key, device in (("cuda0", "cuda:0"), ("all", "cuda"), ("cuda1", "cuda:1")):
        if key == "cuda1" and not index1_alone:
            continue
        cache = d.work / name / key
        if not d.enough(f"{name} prewarm {device}", 120):
            continue
        result = d.ck(f"{name}-prewarm-{key}", "prewarm", str(workload), "--cache-dir",
                      str(cache), "--device", device, "--json")  # fmt: skip
        report = report_of(result) or {}
        out[key] = {
            "device": device,
            "rc": result["rc"],
            "wall_s": result["wall_s"],
            "status": report.get("status"),
            "seconds": report.get("seconds"),
            "children": {r["device"]: r["seconds"] for r in report.get("devices", [])},
            "verify_seconds": (report.get("verify") or {}).get("seconds"),
            "verify_counters": {
                r["device"]: r["counters"] for r in (report.get("verify") or {}).get("devices", [])
            },
            "merged": report.get("merged"),
            "size": dir_stats(cache) if cache.is_dir() else None,
        }
        if cache.is_dir():
            snap = d.ck(f"{name}-snapshot-{key}", "snapshot", str(cache), "-o",
                        str(d.work / name / f"{key}.tar.zst"), "--workload", name, "--json")  # fmt: skip
            manifest = report_of(snap) or {}
            out[key]["snapshot"] = {
                k: manifest.get(k)
                for k in ("id", "devices", "files", "size_bytes", "archive_bytes")
            }
    return out


def index_miss(d: Driver, workload: Path, name: str) -> dict[str, Any]:
    """Item 2: the index-0 cache on cuda:1 (verify, explain, prejob)."""
    out: dict[str, Any] = {}
    c0 = d.work / name / "cuda0"
    if not c0.is_dir() or not d.enough(f"{name} verify cuda:0 cache on cuda:1", 90):
        return out
    copy = d.work / name / "cuda0-on-cuda1"
    shutil.copytree(c0, copy)
    verified = d.ck(f"{name}-verify-cuda0-cache-on-cuda1", "verify", str(workload),
                    "--cache-dir", str(copy), "--device", "cuda:1")  # fmt: skip
    out["verify"] = {"rc": verified["rc"], "wall_s": verified["wall_s"],
                     "reasons": [ln.strip() for ln in verified["stdout"].splitlines()
                                 if "NOT effective:" in ln]}  # fmt: skip
    explained = d.ck(
        f"{name}-explain-cuda0-snapshot", "explain", str(d.work / name / "cuda0.tar.zst")
    )
    out["explain"] = {"rc": explained["rc"], "stdout": explained["stdout"]}
    server = Server(d, f"{name}-index0")
    try:
        server.register(workload, name)
        pushed = d.ck(f"{name}-push-cuda0", "push", str(c0), "--workload", name,
                      "--server", server.url, "--json")  # fmt: skip
        out["push_rc"] = pushed["rc"]
        node = d.work / name / "node"
        cold = d.ck(f"{name}-prejob-all-gpus", "prejob", "--workload", name, "--server",
                    server.url, "--cache-dir", str(node), "--json")  # fmt: skip
        out["prejob_all_gpus"] = {"rc": cold["rc"], "report": report_of(cold),
                                  "stderr": cold["stderr"].strip()}  # fmt: skip
        one = d.ck(f"{name}-prejob-cuda0", "prejob", "--workload", name, "--server", server.url,
                   "--cache-dir", str(node), "--device", "cuda:0", "--json")  # fmt: skip
        out["prejob_cuda0"] = {"rc": one["rc"], "report": report_of(one)}
        status = server.get("/v1/status?devices=cuda:0-7")
        (d.raw / f"{name}-status-devices-0-7.json").write_text(json.dumps(status, indent=2))
        out["status_devices_0_7"] = [
            {k: row.get(k) for k in ("workload", "status", "devices", "uncovered", "note")}
            for row in status["status"]
        ]
    finally:
        server.stop()
    return out


def agent_round(
    d: Driver, workloads: list[tuple[Path, str]]
) -> tuple[dict[str, Any], Server | None]:
    """Item 3: one agent round on every GPU; returns its server for item 4."""
    if not d.enough("agent round", 90 * len(workloads)):
        return {}, None
    server = Server(d, "agent")
    for path, name in workloads:
        server.register(path, name)
    result = d.ck("agent-once", "agent", "--server", server.url, "--device", "cuda", "--once",
                  "--json", "--work-dir", str(d.work / "agent"), "--name", "builder-2gpu")  # fmt: skip
    lines = [ln for ln in result["stdout"].splitlines() if ln.startswith("{")]
    round_report = json.loads(lines[-1]) if lines else {}
    snapshots = server.get("/v1/snapshots")
    status = server.get("/v1/status?devices=cuda:0-7")
    (d.raw / "agent-snapshots.json").write_text(json.dumps(snapshots, indent=2))
    (d.raw / "agent-status.json").write_text(json.dumps(status, indent=2))
    out = {
        "rc": result["rc"],
        "wall_s": result["wall_s"],
        "round_seconds": round_report.get("seconds"),
        "outcomes": [
            {k: o.get(k) for k in ("workload", "status", "snapshot_id", "seconds")}
            for o in round_report.get("outcomes", [])
        ],
        "snapshots": [
            {k: s.get(k) for k in ("id", "workload", "devices", "verified", "size_bytes")}
            for s in snapshots.get("snapshots", snapshots if isinstance(snapshots, list) else [])
        ],
    }
    return out, server


def two_ranks(d: Driver, server: Server, workload: Path, name: str, gpus: int) -> dict[str, Any]:
    """Item 4: one process per GPU, prejob into one dir at the same moment, then the step."""
    if not d.enough("two ranks", 60):
        return {}
    shared = d.work / "ranks" / "inductor"
    before = server.archive_requests()
    start_at = time.time() + 3.0
    procs = []
    for rank in range(gpus):
        out = d.raw / f"rank{rank}.json"
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--rank", str(rank), "--start-at",
             repr(start_at), "--server", server.url, "--workload", str(workload),
             "--shared", str(shared), "--rank-out", str(out)],
            env=d.env, cwd=d.work, stdout=subprocess.DEVNULL,
            stderr=open(d.raw / f"rank{rank}.err", "w"),  # noqa: SIM115
        ))  # fmt: skip
    for proc in procs:
        proc.wait(timeout=max(30.0, d.left()))
    after = server.archive_requests()
    ranks = [json.loads((d.raw / f"rank{r}.json").read_text()) for r in range(gpus)
             if (d.raw / f"rank{r}.json").exists()]  # fmt: skip
    first = min(r["prejob_started_at"] for r in ranks) if ranks else 0.0
    return {
        "workload": name,
        "archive_requests": after - before,
        "ranks": ranks,
        "first_prejob_to_last_first_step_s": round(
            max(r["step_ended_at"] for r in ranks) - first, 3
        )
        if ranks
        else None,  # fmt: skip
    }


def rank_main(args: argparse.Namespace) -> int:
    """One rank of item 4: wait for the common start, prejob, then the first step."""
    (workload,) = args.workload
    time.sleep(max(0.0, args.start_at - time.time()))
    env = dict(os.environ)
    t0 = time.time()
    pre = subprocess.run(
        [sys.executable, "-m", "cachekeeper", "prejob", "--workload", workload_name(workload),
         "--server", args.server, "--cache-dir", str(args.shared), "--json"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    t1 = time.time()
    step_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(args.shared), "TTFS_SPAWN_AT": repr(t1)}
    step = subprocess.run(
        [sys.executable, str(STEP), "--workload", str(workload), "--device",
         f"cuda:{args.rank}"],
        env=step_env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = [ln for ln in step.stdout.splitlines() if ln.startswith("{")]
    result = (
        json.loads(lines[-1]) if lines else {"status": "no result", "stderr": step.stderr[-3000:]}
    )
    counters = result.get("counters") or {}
    args.rank_out.write_text(json.dumps({
        "rank": args.rank,
        "device": f"cuda:{args.rank}",
        "prejob_rc": pre.returncode,
        "prejob": json.loads(pre.stdout) if pre.stdout.strip().startswith("{") else pre.stdout,
        "prejob_stderr": pre.stderr[-2000:],
        "prejob_started_at": t0,
        "prejob_s": round(t1 - t0, 3),
        "step_status": result.get("status"),
        "step_s": result.get("ttfs_s"),
        "step_ended_at": t1 + float(result.get("ttfs_s") or 0.0),
        "misses": counters.get("fxgraph_cache_miss", 0) + counters.get("autograd_cache_miss", 0),
        "counters": counters,
    }, indent=2))  # fmt: skip
    return 0


def _mb(n: Any) -> str:
    return f"{n / 1e6:.1f} MB" if isinstance(n, int | float) else "-"


def format_tables(summary: dict[str, Any]) -> str:
    """The Markdown tables docs/benchmarks.md shows, from a summary.json."""
    lines = [
        "| workload | run | prewarm wall | children (cold) | verify | cache | dedup | archive |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = [k for k, v in summary.items() if isinstance(v, dict) and "prewarm" in v]
    for name in names:
        for run in summary[name]["prewarm"].values():
            size = run.get("size") or {}
            children = ", ".join(f"{d} {s:.1f} s" for d, s in run["children"].items())
            per_index = ", ".join(
                f"triton/{i} {_mb(b)}"
                for i, b in sorted(size.get("triton_bytes_per_index", {}).items())
            )
            dedup = (size.get("bytes") or 0) - (size.get("unique_content_bytes") or 0)
            lines.append(
                f"| {name} | `--device {run['device']}` ({run['status']}) | {run['wall_s']:.1f} s |"
                f" {children} | {run.get('verify_seconds') or 0:.1f} s |"
                f" {_mb(size.get('bytes'))} in {size.get('files')} files ({per_index}) |"
                f" {_mb(dedup)} | {_mb((run.get('snapshot') or {}).get('archive_bytes'))} |"
            )
    lines.append("")
    for name in names:
        miss = summary[name].get("index_miss") or {}
        if miss:
            lines.append(
                f"{name}: verify of the cuda:0 cache on cuda:1: exit {miss['verify']['rc']}"
            )
            lines += [f"    {r}" for r in miss["verify"]["reasons"]]
            lines.append(
                f"{name}: explain exit {miss['explain']['rc']}; prejob (all GPUs):"
                f" {miss['prejob_all_gpus']['stderr']}"
            )
            restored = (miss.get("prejob_cuda0") or {}).get("report") or {}
            lines.append(f"{name}: prejob --device cuda:0: {restored.get('outcome')}")
    agent = summary.get("agent") or {}
    if agent:
        lines.append(
            f"agent --once: exit {agent['rc']} in {agent['wall_s']:.1f} s;"
            f" outcomes {agent['outcomes']}; snapshots {agent['snapshots']}"
        )
    ranks = summary.get("ranks") or {}
    if ranks:
        lines.append(
            f"two ranks ({ranks['workload']}): archive requests {ranks['archive_requests']:g};"
            f" first prejob -> last first step {ranks['first_prejob_to_last_first_step_s']} s"
        )
        for r in ranks["ranks"]:
            outcome = r["prejob"].get("outcome") if isinstance(r["prejob"], dict) else r["prejob"]
            lines.append(
                f"    rank {r['rank']} {r['device']}: prejob {outcome} in {r['prejob_s']} s,"
                f" step {r['step_status']} {r['step_s']} s, misses {r['misses']}"
            )
    if summary.get("skipped"):
        lines.append(f"skipped: {summary['skipped']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", type=Path, action="append", default=[])
    parser.add_argument(
        "--agent-workload",
        action="append",
        default=[],
        help="workload names (of --workload) the agent and the ranks use",
    )
    parser.add_argument("--raw", type=Path, help="where every raw output goes")
    parser.add_argument("--work", type=Path, help="scratch (default: a temp dir, removed)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--deadline-s", type=float, default=560.0)
    parser.add_argument("--tables", type=Path, help="print the tables of this summary.json")
    # one rank of item 4 (the driver starts these)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--start-at", type=float)
    parser.add_argument("--server")
    parser.add_argument("--shared", type=Path)
    parser.add_argument("--rank-out", type=Path)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(args)
    if args.tables is not None:
        print(format_tables(json.loads(args.tables.read_text())))
        return 0
    if not args.workload or args.raw is None:
        parser.error("--workload and --raw are required")
    args.raw.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="ck-multigpu-"))
    work.mkdir(parents=True, exist_ok=True)
    d = Driver(raw=args.raw.absolute(), work=work.absolute(), deadline_s=args.deadline_s)
    workloads = [(p.absolute(), workload_name(p)) for p in args.workload]
    d.summary["versions"] = json.loads(d.ck("fingerprint", "fingerprint", "--json")["stdout"])
    agent_set = [(p, n) for p, n in workloads if n in args.agent_workload]
    try:
        for index, (path, name) in enumerate(workloads):
            d.summary[name] = {"prewarm": prewarms(d, path, name, index1_alone=index == 0)}
            d.summary[name]["index_miss"] = index_miss(d, path, name)
            d.save()
            if index == 0 and agent_set:  # the agent and the ranks after the first workload
                d.summary["agent"], server = agent_round(d, agent_set)
                if server is not None:
                    try:
                        path4, name4 = agent_set[0]
                        d.summary["ranks"] = two_ranks(d, server, path4, name4, args.gpus)
                    finally:
                        server.stop()
                d.save()
    finally:
        d.save()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: v for k, v in d.summary.items() if k != "commands"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
