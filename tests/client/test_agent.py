"""client/agent.py without compiles: the daemon loop against a real server with nothing
registered (every round registers and lists, builds nothing), and a signing agent's notion
of warm. The builds themselves are tests/e2e/test_agent.py's."""

from __future__ import annotations

from pathlib import Path

import httpx

from cachekeeper.allowlist import Allowlist
from cachekeeper.children import child_cpu_state
from cachekeeper.client.agent import (
    KEEP_REPORTS,
    AgentOptions,
    RoundReport,
    StopSignal,
    run_agent,
    run_round,
)
from cachekeeper.client.api import CacheClient
from cachekeeper.fingerprint import collect, with_cpu
from cachekeeper.signing import generate_keypair
from cachekeeper.snapshot import snapshot_dir
from cachekeeper.store import LocalStore
from tests.helpers.caches import make_cache
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


def test_a_signing_agent_takes_only_what_its_own_key_signed_as_warm(
    open_server: LiveServer, tmp_path: Path
) -> None:
    """Issue 32: an unsigned snapshot that claims "verified" was warm for the signing agent,
    which then rebuilt nothing. Its workload holds a command nothing allows, so a round
    that does not find it warm reports ``refused`` (it would build), one that does
    ``skipped``."""
    url = open_server.url
    httpx.put(f"{url}/v1/workloads/w", content='name = "w"\n[[command]]\nargv = ["/bin/true"]\n')
    key, _pub, _ = generate_keypair(tmp_path / "keys" / "builder")
    store = LocalStore(home=tmp_path / "home")

    def publish(name: str, sign_key: Path | None) -> str:
        cache = tmp_path / name
        make_cache(cache)
        (cache / "tag").write_text(name)
        manifest = snapshot_dir(
            cache,
            store=store,
            workload="w",
            stats={"verify": {"effective": True}},
            fingerprint=with_cpu(collect(), child_cpu_state(None)),
            sign_key=sign_key,
        )
        for digest in manifest.digests:
            httpx.put(f"{url}/v1/blobs/{digest}", content=store.blobs.read(digest))
        assert httpx.post(f"{url}/v1/snapshots", content=manifest.to_json()).status_code == 201
        return manifest.id

    def outcome(sign_key: Path | None) -> tuple[str, str | None]:
        options = AgentOptions(
            devices=("cpu",), work_dir=tmp_path / "work", sign_key=sign_key, allow=Allowlist()
        )
        with CacheClient(base_url=url) as client:
            (done,) = run_round(options, client=client).outcomes
        return done.status, done.snapshot_id

    unsigned = publish("unsigned", None)
    assert outcome(None) == ("skipped", unsigned)  # an agent that signs nothing: as before
    assert outcome(key)[0] == "refused"  # not its own: it would build
    own = publish("own", key)
    publish("newer-unsigned", None)
    assert outcome(key) == ("skipped", own)
