"""Issue 31: what the operator is told is true, after the two-node scenario a new site ran.

tests/helpers/two_nodes.py runs it for real: a server with admin/write/read tokens, a real
agent that builds the site's two-rank torchrun job (a ``[[command]]``) and refuses a
command it does not allow; then two training nodes, each with the
docs' ``OMP_NUM_THREADS=1`` before ``prejob``, their real torchrun job and ``postjob``.
Before issue 31 the nodes' digest (``OMP_NUM_THREADS=1``) was not the snapshot's (``the
command's processes``): ``status`` said ``0 restored`` for the row of the snapshot that
served both nodes, the page ``restored 0%``, and the agent's own column said ``missing``
for the command it had built warm.

Every check is what a site reads: ``cachekeeper status``, ``GET /v1/status``, the hooks'
lines, and the status page in Chromium (Playwright): the count of restored jobs in the cell
of the snapshot that served them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachekeeper.fingerprint import collect, digest_of
from cachekeeper.server.settings import Settings
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.requires import require
from tests.helpers.two_nodes import CK, NODE, TOKENS, Scenario, run_scenario

pytestmark = [
    pytest.mark.compile,  # real torch.compile runs in the agent's and the nodes' processes
    pytest.mark.timeout(1800),  # the scenario: a cold and a warm torchrun, then two jobs
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 ranks"),
]
CHROMIUM = "/usr/bin/chromium"
READ = {"Authorization": f"Bearer {NODE}"}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Scenario]]:
    require("torch")
    root = tmp_path_factory.mktemp("two-nodes")
    with start_server(Settings(data_dir=root / "server", tokens=TOKENS)) as live:
        yield live, run_scenario(live.url, root)


def _rows(live: LiveServer) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {}
    for row in httpx.get(f"{live.url}/v1/status", headers=READ).json()["status"]:
        rows.setdefault(row["workload"], []).append(row)
    return rows


def test_both_nodes_restored_the_command_snapshot_and_every_rank_hit(scenario: Any) -> None:
    _live, done = scenario
    built = done.outcome("block")
    assert built["status"] == "built", built
    for node in done.nodes:
        assert f"restored snapshot {built['snapshot_id']}" in node.prejob, node.prejob
        for rank, counters in node.ranks.items():
            assert counters["fxgraph_cache_miss"] == 0, (node.name, rank, counters)
            assert counters["autograd_cache_miss"] == 0, (node.name, rank, counters)
            assert counters["fxgraph_cache_hit"] >= 1, (node.name, rank, counters)
        # no false alarm: a job that compiled no graph is never told its workload is wrong
        assert "compiled no graph" in node.postjob or "compiled nothing new" in node.postjob
        assert "does not match training" not in node.postjob, node.postjob


def test_the_restores_count_in_the_row_of_the_snapshot_that_served_them(scenario: Any) -> None:
    live, done = scenario
    built = done.outcome("block")
    (row,) = _rows(live)["block"]
    assert (row["fingerprint_digest"], row["snapshot_id"]) == (
        built["fingerprint_digest"],
        built["snapshot_id"],
    )
    jobs = row["jobs"]
    assert (jobs["restores"], jobs["cold"], jobs["postjobs"], jobs["compiled"]) == (2, 0, 2, 0)
    assert row["jobs_note"] is None
    # the nodes' own digest is now the snapshot's: provenance is in no identity
    node_fp = collect(environ={"OMP_NUM_THREADS": "1"})
    assert digest_of(node_fp) == row["fingerprint_digest"]
    # and the nodes' default cache dir is named by it
    assert all(Path(n.cache_dir).name == row["fingerprint_digest"][:16] for n in done.nodes)

    env = {**os.environ, "CACHEKEEPER_SERVER": live.url, "CACHEKEEPER_TOKEN": NODE}
    out = subprocess.run(
        [CK, "status", "--workload", "block"], capture_output=True, text=True, env=env, timeout=60
    ).stdout
    assert "  jobs: 2 restored, 0 cold, 0 of 2 compiled anyway" in out, out


def test_one_agent_and_no_missing_cell_where_the_agent_built_warm(scenario: Any) -> None:
    live, done = scenario
    first, second = done.agent_rounds
    assert first["agent_id"] == second["agent_id"]
    assert second["prewarms_run"] == 0, second  # warm: nothing compiled again
    agents = httpx.get(f"{live.url}/v1/agents", headers=READ).json()["agents"]
    assert [a["name"] for a in agents] == ["builder"]
    rows = _rows(live)
    # one row for block, the ranks' environment's: no phantom "missing" row in the agent's
    (block,) = rows["block"]
    assert block["status"] == "warm" and block["agents"] == ["builder"]
    # the refused command says why, in the CLI too (not only --json or a tooltip)
    (refused,) = rows["foreign"]
    assert refused["status"] == "refused"
    env = {**os.environ, "CACHEKEEPER_SERVER": live.url, "CACHEKEEPER_TOKEN": NODE}
    out = subprocess.run(
        [CK, "status", "--workload", "foreign"], capture_output=True, text=True, env=env, timeout=60
    ).stdout
    assert refused["last_event"]["detail"].startswith("refused: command[0].argv command ")
    said = "  ! refused: command[0].argv command '/opt/vendor/bin/launch --steps 2'"
    assert said in out, out


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install chromium, as root)")
    try:
        from playwright.sync_api import sync_playwright  # only the browser tests need it
    except ImportError:
        pytest.skip("no browser driver: Playwright for Python is not installed")
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


def test_the_page_counts_the_restores_in_the_snapshots_cell(scenario: Any, browser: Any) -> None:
    live, done = scenario
    built = done.outcome("block")
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{live.url}/")
    page.fill("input[name=token]", NODE)
    page.click("#login button")
    page.wait_for_selector("#matrix")
    digest = built["fingerprint_digest"]
    cell = page.locator(f'td.cell[data-workload="block"][data-digest="{digest}"]')
    assert cell.get_attribute("data-state") == "warm_verified"
    assert "restored 100%" in cell.inner_text(), cell.inner_text()
    # no cell of the matrix says "missing": the agent built every workload it may build;
    # block in the agent's own column (its ranks compile with 1 thread) is an empty cell
    assert page.locator('#matrix td[data-state="missing"]').count() == 0
    assert page.locator('td.cell[data-workload="block"][data-state="none"]').count() == 1
    # the refused command's cell (the agent's own column) says why, not only its tooltip
    refused = page.locator('td.cell[data-workload="foreign"][data-state="refused"]')
    assert refused.count() == 1 and "/opt/vendor/bin/launch" in refused.inner_text()
    agents = page.locator("#agents tr").all_inner_texts()
    assert len(agents) == 2 and agents[1].startswith("builder"), agents  # header + one
    cell.locator("a").click()
    page.wait_for_url(re.compile(r".*/ui/cell\?.*"))
    assert "Job reports: 2 restores, 0 cold starts" in page.locator("#jobs").inner_text()
    assert errors == []
    json.dumps(done.agent_rounds)  # the rounds are plain JSON (the screenshot script logs them)
