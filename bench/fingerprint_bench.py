"""How long collecting the fingerprint takes (the pre-job hook pays it on every job).

    python bench/fingerprint_bench.py [--runs 10]
    python bench/fingerprint_bench.py --runs 30 --against DIR

Reports the median of in-process ``collect()`` calls (first call separately: it pays the
imports) and of fresh ``python -m cachekeeper fingerprint --json`` processes against a bare
``python -c pass`` in the same run. Target: well under 300 ms on a node with torch installed.

``--against DIR`` (a checkout of another version, e.g. ``git archive REV | tar -x -C DIR``)
A/Bs this checkout against it instead, in one run: for ``--runs`` rounds, with the order
swapped every round, each version runs in fresh processes (``PYTHONPATH`` set to its
folder): the first ``collect()`` with its imports, later ``collect()`` calls, and the
``fingerprint --json`` process. Printed: the median of each per version and the ratio of
this checkout to ``DIR`` (a shared host varies by 10-20 % from run to run; alternating
rounds keeps that noise on both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_DROPPED = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")

# One fresh process: the import and first collect(), then five more (ms, as JSON).
_IN_PROCESS = (
    "import json, time; t0 = time.perf_counter();"
    " from cachekeeper.environment.fingerprint import collect; collect();"
    " first = (time.perf_counter() - t0) * 1000; later = []\n"
    "for _ in range(5):\n"
    "    t1 = time.perf_counter(); collect(); later.append((time.perf_counter() - t1) * 1000)\n"
    "import cachekeeper; print(json.dumps({'first': first, 'later': sorted(later)[2],"
    " 'module': cachekeeper.__file__}))"
)


def _wall(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=cwd)
    return time.perf_counter() - t0


def _env(site: Path, pycache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    # bytecode written and reused, as on an installed node, each version's in its own folder
    env.update(PYTHONPATH=str(site), PYTHONPYCACHEPREFIX=str(pycache))
    return env


def _one_round(site: Path, pycache: Path) -> dict[str, float]:
    env, run = _env(site, pycache), [sys.executable]  # in the site: -c and -m put the cwd first
    out = subprocess.run(
        [*run, "-c", _IN_PROCESS], check=True, capture_output=True, text=True, env=env, cwd=site
    )
    found = json.loads(out.stdout)
    if not found["module"].startswith(str(site)):  # the other version would be measured
        raise SystemExit(f"{site}: imported cachekeeper from {found['module']}")
    cli = _wall([*run, "-m", "cachekeeper", "fingerprint", "--json"], env, site) * 1000
    return {"first_ms": found["first"], "later_ms": found["later"], "process_ms": cli}


def ab(runs: int, against: Path) -> None:
    sites = {"this": REPO, "against": against.resolve()}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in sites}
    with tempfile.TemporaryDirectory() as tmp:
        caches = {name: Path(tmp) / name for name in sites}
        for name, site in sites.items():  # warm both: bytecode written, files in the page cache
            _one_round(site, caches[name])
        for r in range(runs):
            order = list(sites) if r % 2 == 0 else list(reversed(sites))
            for name in order:
                for case, value in _one_round(sites[name], caches[name]).items():
                    times[name].setdefault(case, []).append(value)
    print(f"this: {REPO}  against: {sites['against']}  ({runs} rounds, alternating)")
    print(f"{'case':<12}{'this':>10}{'against':>10}{'ratio':>8}")
    for case in ("first_ms", "later_ms", "process_ms"):
        mine = statistics.median(times["this"][case])
        theirs = statistics.median(times["against"][case])
        print(f"{case:<12}{mine:>10.1f}{theirs:>10.1f}{mine / theirs:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--against", type=Path, help="A/B against another version's folder")
    args = parser.parse_args()
    if args.against is not None:
        ab(args.runs, args.against)
        return

    t0 = time.perf_counter()
    from cachekeeper.environment.fingerprint import collect

    collect()
    first_ms = (time.perf_counter() - t0) * 1000
    calls = []
    for _ in range(args.runs):
        t1 = time.perf_counter()
        collect()
        calls.append((time.perf_counter() - t1) * 1000)
    bare = [_wall([sys.executable, "-c", "pass"]) * 1000 for _ in range(args.runs)]
    cli = [
        _wall([sys.executable, "-m", "cachekeeper", "fingerprint", "--json"]) * 1000
        for _ in range(args.runs)
    ]
    torch_there = "torch" in collect() and collect()["torch"] is not None
    print(f"torch installed: {torch_there} ({collect()['torch']})")
    print(f"first collect() incl. imports: {first_ms:.1f} ms")
    print(f"collect() median of {args.runs}: {statistics.median(calls):.1f} ms")
    print(f"`python -c pass` median: {statistics.median(bare):.1f} ms")
    print(f"`python -m cachekeeper fingerprint --json` median: {statistics.median(cli):.1f} ms")
    print(
        f"fingerprint process minus bare interpreter: {statistics.median(cli) - statistics.median(bare):.1f} ms"
    )


if __name__ == "__main__":
    main()
