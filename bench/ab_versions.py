"""A/B two installs of cachekeeper on the hook's paths, alternating, in one run.

    python bench/ab_versions.py --site old=/tmp/site-old --site new=/tmp/site-new \
        [--size-mb 350] [--rounds 5] [--noop 3] [--json]

Each ``--site NAME=DIR`` is a folder a cachekeeper wheel was installed into
(``pip install --target DIR``); the dependencies come from this interpreter's path. Each
install gets its own server on loopback (its own ``cachekeeper serve``) holding the same
synthetic cache (bench/synthetic_cache.py), pushed by its own client, and its own one-file
snapshot of it. Then, for ``--rounds`` rounds, with the order of the installs swapped
every round and ``os.sync()`` before each timed command, each install runs:

- ``prejob`` into an empty dir (cold: download and verified restore over loopback),
- ``restore ARCHIVE`` into an empty dir (the restore alone, from local disk),
- ``--noop`` times ``prejob`` again on the restored dir (the already-restored path).

Printed: the median of each case per install and the ratio of each install to the first
(``--json`` for every timing). A change is "not slower" when the ratios stay near 1.0
across reruns; single runs on a shared host vary by 10-20 %.
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
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.synthetic_cache import make_synthetic_cache  # noqa: E402
from tests.helpers.ports import free_port  # noqa: E402

CASES = ("prejob_cold_s", "restore_local_s", "prejob_noop_s")


class Install:
    """One install: its environment, its server, its archive."""

    def __init__(self, name: str, site: Path, work: Path) -> None:
        self.name = name
        self.work = work / name
        self.work.mkdir()
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("CACHEKEEPER_") and k != "PYTHONDONTWRITEBYTECODE"
        }
        self.env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            CACHEKEEPER_HOME=str(self.work / "home"),
            PYTHONPYCACHEPREFIX=str(self.work / "pycache"),
        )
        self.server: subprocess.Popen[bytes] | None = None
        self.url = ""

    def ck(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "cachekeeper", *args],
            env=self.env,
            cwd=self.work,  # not the repo root: the install under test, not the checkout
            capture_output=True,
            text=True,
            timeout=900,
        )
        if check and proc.returncode != 0:
            raise SystemExit(f"{self.name}: cachekeeper {' '.join(args)} failed:\n{proc.stderr}")
        return proc

    def start(self, src: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = open(self.work / "server.log", "wb")  # noqa: SIM115 (kept open while it runs)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "cachekeeper", "serve", "--host", "127.0.0.1"]
            + ["--port", str(port), "--data", str(self.work / "data")],
            env=self.env,
            cwd=self.work,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not _healthy(self.url):
            if time.monotonic() > deadline or self.server.poll() is not None:
                raise SystemExit(f"{self.name}: server did not come up; see {log.name}")
            time.sleep(0.2)
        extra = (
            ["--allow-unregistered"]
            if "--allow-unregistered" in self.ck("push", "--help").stdout
            else []
        )
        self.ck("push", str(src), "--workload", "bench", "--server", self.url, *extra)
        self.ck("snapshot", str(src), "-o", str(self.work / "snap.tar.zst"), "--workload", "bench")
        self.ck("prejob", "--workload", "bench", "--cache-dir", str(self.work / "warm"))

    def stop(self) -> None:
        if self.server is not None:
            self.server.terminate()
            self.server.wait(timeout=30)

    def timed(self, *args: str) -> float:
        os.sync()
        started = time.perf_counter()
        proc = self.ck(*args)
        elapsed = time.perf_counter() - started
        if "no cache restored" in proc.stderr:
            raise SystemExit(f"{self.name}: {' '.join(args)} went cold:\n{proc.stderr}")
        return elapsed

    def round(self, i: int, noop: int) -> dict[str, list[float]]:
        cold = self.work / f"cold-{i}"
        local = self.work / f"local-{i}"
        prejob = ["prejob", "--workload", "bench", "--server", self.url, "--cache-dir"]
        out = {
            "prejob_cold_s": [self.timed(*prejob, str(cold))],
            "restore_local_s": [
                self.timed("restore", str(self.work / "snap.tar.zst"), "--cache-dir", str(local))
            ],
            "prejob_noop_s": [self.timed(*prejob, str(cold)) for _ in range(noop)],
        }
        shutil.rmtree(cold)
        shutil.rmtree(local)
        return out


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--size-mb", type=int, default=350)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--noop", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ck-ab-"))
    installs = []
    try:
        src = work / "src"
        make_synthetic_cache(src, size_mb=args.size_mb, seed=0)
        for spec in args.site:
            name, _, site = spec.partition("=")
            installs.append(Install(name, Path(site).resolve(), work))
        for install in installs:
            install.start(src)
        times: dict[str, dict[str, list[float]]] = {
            i.name: {c: [] for c in CASES} for i in installs
        }
        for r in range(args.rounds):
            order = installs if r % 2 == 0 else list(reversed(installs))
            for install in order:
                for case, values in install.round(r, args.noop).items():
                    times[install.name][case].extend(values)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for install in installs:
            install.stop()
        shutil.rmtree(work, ignore_errors=True)

    medians = {n: {c: statistics.median(v) for c, v in t.items()} for n, t in times.items()}
    first = installs[0].name
    result = {
        "size_mb": args.size_mb,
        "rounds": args.rounds,
        "medians": medians,
        "ratios_to_" + first: {
            n: {c: m[c] / medians[first][c] for c in CASES} for n, m in medians.items()
        },
        "times": times,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.size_mb} MB synthetic cache, {args.rounds} rounds, medians (ratio to {first})")
    for case in CASES:
        cells = [
            f"{n} {medians[n][case] * 1000:7.0f} ms ({medians[n][case] / medians[first][case]:.2f}x)"
            for n in medians
        ]
        print(f"{case:16} " + "   ".join(cells))


if __name__ == "__main__":
    main()
