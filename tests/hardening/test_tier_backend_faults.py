"""cachekeeper's own tier backend never breaks a job: real compiles against a tier that fails.

Each case runs a job (tests/tier_job.py: two small torch.compile calls, checked against
eager, printing their results) in a fresh process with an empty cache dir, with the
exports ``prejob`` gives a node on cachekeeper's backend (``client.tier.tier_exports``,
no redis-py), while the tier fails in one way:

- the server (a ``cachekeeper serve`` process) frozen with SIGSTOP after prejob: it
  accepts connections and answers nothing;
- the connection cut in the middle of a value (a relay in front of the real server that
  drops the answer 2,000 bytes in: what a server killed mid-send looks like to a client);
- every tier call answered 500, or answered with bytes that are not HTTP;
- the answer trickled a byte every 0.2 s (headers included);
- the node's token no longer known to the server (expired, revoked): 401.

Each job must finish, exit 0, print the same results as the job without a tier, and log
no error. The fault is proved to have happened (the relay saw the tier's request; the
process's counts show a failed call), and the circuit breaker to have opened after that
one call: the rest of the process asked nothing, so the fault cost one deadline. Each
case's wall time minus the no-tier job's is printed (``-s``), not asserted: the 3 s claim
is measured by bench/tier_fault_bench.py (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cachekeeper import config
from cachekeeper.client.prejob import prejob
from cachekeeper.client.tier import tier_exports
from cachekeeper.server.settings import Settings
from cachekeeper.wire import RemoteCacheOffer, from_dict
from tests.hardening.conftest import REPO, ServerProcess
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.ports import free_port
from tests.helpers.slow_servers import FakeServer, Request, answer, dribble, forward

pytestmark = [pytest.mark.compile]  # real torch.compile runs through the backend

JOB = REPO / "tests" / "tier_job.py"
TOKENS = {"node-write": "write"}
ENVIRONMENT = "0123456789ab"


@dataclass(frozen=True)
class Run:
    out: dict
    seconds: float
    stats: list[dict]  # what each process of the job left (tier-<pid>.json)


def job_env(exports: dict[str, str], home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHINDUCTOR_", "CACHEKEEPER_")) and k != "PYTHONPATH"
    }
    return {**env, **exports, "CACHEKEEPER_HOME": str(home)}


def run_job(cache: Path, exports: dict[str, str], home: Path) -> Run:
    env = {**job_env(exports, home), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(JOB)], env=env, capture_output=True, text=True, timeout=600
    )
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    bad = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith(("ERROR", "CRITICAL", "Traceback"))
    ]
    assert not bad, proc.stderr[-4000:]
    folder = exports.get(config.TIER_STATS_DIR)
    stats = (
        [json.loads(p.read_text()) for p in sorted(Path(folder).glob("tier-*.json"))]
        if folder
        else []
    )
    return Run(json.loads(proc.stdout.strip().splitlines()[-1]), seconds, stats)


def backend_exports(offer: RemoteCacheOffer, server: str, tmp: Path, **extra) -> dict[str, str]:
    choice = tier_exports(
        offer,
        server=server,
        token="node-write",
        wish="on",
        client_name="ck:fault:0",
        backend="cachekeeper",
        environment=ENVIRONMENT,
        stats_dir=tmp / "stats",
        environ={"CACHEKEEPER_HOME": str(tmp / "home")},
        **extra,
    )
    assert choice.used and choice.backend == "cachekeeper", choice
    return choice.exports


def offer_of(url: str) -> RemoteCacheOffer:
    got = httpx.get(f"{url}/v1/remote-cache", headers={"Authorization": "Bearer node-write"})
    assert got.status_code == 200, got.text
    return from_dict(RemoteCacheOffer, got.json())


@dataclass(frozen=True)
class Filled:
    server: LiveServer
    offer: RemoteCacheOffer
    baseline: Run  # the job with no tier at all


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Filled]:
    """A real server whose tier holds the job's values (one job put them), and the job's
    run without a tier."""
    tmp = tmp_path_factory.mktemp("tier-faults")
    with start_server(Settings(data_dir=tmp / "data", tokens=TOKENS, resp_port=0)) as server:
        offer = offer_of(server.url)
        fill = run_job(
            tmp / "fill", backend_exports(offer, server.url, tmp, call_timeout_s=10.0), tmp / "h"
        )
        assert fill.stats and fill.stats[0]["puts"]["stored"] >= 4, fill.stats
        baseline = run_job(tmp / "baseline", {}, tmp / "h")
        assert baseline.out["inductor"]["fxgraph_cache_miss"] == 2
        yield Filled(server, offer, baseline)


def garbage() -> Callable[[socket.socket, Request, threading.Event], None]:
    def route(conn: socket.socket, request: Request, stop: threading.Event) -> None:
        conn.sendall(b"\x16\x03\x01 this is not HTTP at all\r\n\r\n\x00\xff")

    return route


def check(run: Run, baseline: Run, *, case: str) -> None:
    assert run.out["outputs"] == baseline.out["outputs"], case  # the same job output
    [stats] = [s for s in run.stats if s.get("installed")]
    assert stats["breaker"] is not None, stats  # the fault was met ...
    failed = stats["gets"]["failed"] + stats["puts"]["failed"]
    assert failed == 1, stats  # ... once: the rest of the process asked nothing
    print(
        f"{case}: job {run.seconds:.1f} s, no tier {baseline.seconds:.1f} s, difference"
        f" {run.seconds - baseline.seconds:+.1f} s; breaker: {stats['breaker'][:80]}"
    )


RELAYED = {
    "errors": lambda url: answer(b'{"error": "server_error"}', status=500),
    "garbage": lambda url: garbage(),
    "trickle": lambda url: dribble(every_s=0.2, headers_too=True),
    "cut mid-value": lambda url: forward(url, cut_after_bytes=2000),
}


@pytest.mark.parametrize("case", sorted(RELAYED))
def test_a_tier_that_fails_costs_the_job_one_call(
    filled: Filled, tmp_path: Path, case: str, reliability
) -> None:
    live = filled.server.url
    with FakeServer({"/": forward(live), "/v1/tier/values/": RELAYED[case](live)}) as relay:
        run = run_job(tmp_path / "cache", backend_exports(filled.offer, relay.url, tmp_path),
                      tmp_path / "h")  # fmt: skip
        asked = [r for r in relay.requests if r.path.startswith("/v1/tier/values/")]
    assert len(asked) >= 1  # the relay broke a real tier request
    check(run, filled.baseline, case=case)
    reliability.record(f"tier backend: {case}", tries=1, outcome="kept", area="per-key tier")


def test_an_expired_token_costs_the_job_one_call(filled: Filled, tmp_path: Path, reliability):
    exports = backend_exports(filled.offer, filled.server.url, tmp_path)
    token_file = Path(exports[config.TIER_TOKEN_FILE])
    token_file.write_text("a-token-the-server-revoked")  # the file prejob left, now stale
    run = run_job(tmp_path / "cache", exports, tmp_path / "h")
    check(run, filled.baseline, case="expired token")
    assert "HTTP 401" in run.stats[0]["breaker"]  # the server refused the token
    reliability.record("tier backend: expired token", tries=1, outcome="kept",
                       area="per-key tier")  # fmt: skip


def test_a_server_frozen_after_prejob_costs_the_job_one_deadline(
    filled: Filled, tmp_path: Path, reliability, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = ServerProcess(
        data_dir=tmp_path / "server-data",
        home=tmp_path / "server-home",
        args=("--resp-port", str(free_port())),
        env={"CACHEKEEPER_TOKENS": json.dumps(TOKENS)},
    ).start()
    assert server.proc is not None
    monkeypatch.setenv("CACHEKEEPER_HOME", str(tmp_path / "home"))
    try:
        done = prejob(
            workload="w", server=server.url, token="node-write", cache_dir=tmp_path / "cache",
            report=False,
        )  # fmt: skip
        assert done.remote_cache_backend == "cachekeeper", done
        os.kill(server.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        run = run_job(tmp_path / "cache", done.exports, tmp_path / "home")
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.kill()
    check(run, filled.baseline, case="frozen after prejob")
    assert "deadline" in run.stats[0]["breaker"] or "timed out" in run.stats[0]["breaker"]
    reliability.record(
        "tier backend: server frozen after prejob", tries=1, outcome="kept",
        area="per-key tier",
    )  # fmt: skip
