"""Code in registered workloads (issue 24's first class, closed by issue 23's checks).

The attack: a write token registered a workload whose entrypoint was ``os:system``; an
agent ran it as root, read the builder's signing key, and the attacker's snapshot signed
with it was restored by a trusting node. Two checks now stand in the way, each tried here
against a real server and a real agent round: registering code needs the admin scope, and
an agent runs only code its operator's ``--allow`` admits. Nothing here compiles.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from cachekeeper.allowlist import Allowlist
from cachekeeper.client.agent import AgentOptions, run_round
from cachekeeper.client.api import CacheClient
from cachekeeper.server.settings import Settings
from tests.helpers.live_server import start_server

TOKENS = {"builder-tok": "write", "ops-tok": "admin"}


def _codes(marker: Path) -> dict[str, str]:
    """Workloads that would each create ``marker`` if a builder ran them."""
    shell = f'["sh", "-c", "touch {marker}"]'
    return {
        "entrypoint": 'name = "evil"\n[[entrypoint]]\ntarget = "os:system"\n'
        f'kwargs = {{ command = "touch {marker}" }}\n',
        "command": f'name = "evil"\n[[command]]\nargv = {shell}\n',
        "mask": 'name = "evil"\n[[attention]]\nbatch = 1\nq_heads = 2\nhead_dim = 16\n'
        'seq_lens = [64]\ndtype = "float32"\nmask = "os:system"\n',
    }


@pytest.mark.parametrize("kind", ["entrypoint", "command", "mask"])
def test_a_write_token_cannot_register_code(tmp_path: Path, kind: str, reliability) -> None:
    with start_server(Settings(data_dir=tmp_path / "data", tokens=TOKENS)) as live:
        answer = httpx.put(
            f"{live.url}/v1/workloads/evil",
            content=_codes(tmp_path / "ran")[kind],
            headers={"Authorization": "Bearer builder-tok"},
        )
        assert answer.status_code == 403 and answer.json()["error"] == "forbidden", answer.text
        listed = httpx.get(
            f"{live.url}/v1/workloads", headers={"Authorization": "Bearer builder-tok"}
        )
        assert listed.json()["workloads"] == []
    reliability.record(
        f"a write token registers a workload with code ({kind}: os:system, sh -c)",
        tries=1,
        outcome="refused",
        area="scopes",
    )


def test_an_agent_runs_no_code_its_operator_did_not_allow(tmp_path: Path, reliability) -> None:
    """Registered by an admin, still refused by every builder that did not allow it: with
    no pattern, and with patterns that admit other code. Nothing of it runs."""
    marker = tmp_path / "ran"
    with start_server(Settings(data_dir=tmp_path / "data", tokens=TOKENS)) as live:
        admin = {"Authorization": "Bearer ops-tok"}
        for kind, toml in _codes(marker).items():
            name = f"evil-{kind}"
            body = toml.replace('name = "evil"', f'name = "{name}"')
            httpx.put(
                f"{live.url}/v1/workloads/{name}", content=body, headers=admin
            ).raise_for_status()
        tries = 0
        for patterns in ((), ("mytrainer.*", "/opt/venv/bin/torchrun ...", "/bin/sh -c true")):
            options = AgentOptions(
                devices=("cpu",),
                work_dir=tmp_path / "work",
                name="builder",
                allow=Allowlist.load(patterns),
            )
            with CacheClient(base_url=live.url, token="builder-tok") as client:
                report = run_round(options, client=client)
            assert [o.status for o in report.outcomes] == ["refused"] * 3, report.outcomes
            assert all(not o.prewarm_ran and o.reported for o in report.outcomes)
            assert not marker.exists()  # nothing ran
            tries += len(report.outcomes)
        rows = httpx.get(f"{live.url}/v1/status", headers=admin).json()["status"]
        assert {r["workload"]: r["status"] for r in rows} == {
            "evil-command": "refused",
            "evil-entrypoint": "refused",
            "evil-mask": "refused",
        }
        assert all("agent --allow" in r["last_event"]["detail"] for r in rows)
    reliability.record(
        "an admin-registered workload with code (os:system, sh -c, a mask factory) reaches a"
        " builder whose --allow does not admit it",
        tries=tries,
        outcome="refused",
        area="scopes",
    )
