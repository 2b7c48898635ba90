"""client/agent.py without compiles: the daemon loop against a real server with nothing
registered (every round registers and lists, builds nothing). The builds themselves are
tests/e2e/test_agent.py's."""

from __future__ import annotations

from pathlib import Path

from cachekeeper.client.agent import KEEP_REPORTS, AgentOptions, RoundReport, StopSignal, run_agent
from cachekeeper.client.api import CacheClient

from tests.helpers.live_server import LiveServer


def test_the_daemon_keeps_only_the_newest_round_reports(
    open_server: LiveServer, tmp_path: Path
) -> None:
    """Issue 25: the daemon kept every round's report in memory, forever."""
    seen: list[RoundReport] = []
    stop = StopSignal()
    rounds = KEEP_REPORTS * 3

    def on_round(report: RoundReport) -> None:
        seen.append(report)
        if len(seen) == rounds:
            stop.set()

    options = AgentOptions(devices=("cpu",), work_dir=tmp_path / "work", name="b")
    with CacheClient(base_url=open_server.url) as client:
        kept = run_agent(options, client=client, interval_s=0.0, stop=stop, on_round=on_round)
    assert len(seen) == rounds  # every round was handed out
    assert kept == seen[-KEEP_REPORTS:]  # and only the newest stayed
    with CacheClient(base_url=open_server.url) as client:
        few = run_agent(options, client=client, interval_s=0.0, once=True, keep_reports=1)
    assert len(few) == 1
