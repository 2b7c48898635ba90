"""The agent's rounds: register, then keep every registered workload warm (``run_round``),
every interval until stopped (``run_agent``)."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from cachekeeper import config, remote_tier
from cachekeeper.builder.agent.keep_warm import KeepWarm, sweep_stale_builds
from cachekeeper.builder.agent.options import AgentMemory, AgentOptions, Log, prepare_options
from cachekeeper.builder.agent.outcomes import RoundReport, WorkloadOutcome
from cachekeeper.builder.agent.stop import StopSignal
from cachekeeper.environment.fingerprint import collect, digest_of
from cachekeeper.errors import CachekeeperError, ServerUnavailable
from cachekeeper.snapshot.signing import public_key_of

if TYPE_CHECKING:
    from cachekeeper.client.api import CacheClient

__all__ = ["KEEP_REPORTS", "run_agent", "run_round"]

KEEP_REPORTS = 16  # round reports run_agent keeps in memory (the newest)


def _utc_now() -> str:
    # Not wire.utc_now: a round's started_at is `agent --json` output, in whole seconds.
    return datetime.now(UTC).isoformat(timespec="seconds")


def run_round(
    options: AgentOptions,
    *,
    client: CacheClient,
    stop: StopSignal | None = None,
    log: Log | None = None,
    previous_digest: str | None = None,
    memory: AgentMemory | None = None,
) -> RoundReport:
    """Register, then make every registered workload warm for this environment.

    Raises ServerUnavailable (or the server's error) when registering or listing the
    workloads fails; a failure while building one workload is that workload's outcome.
    """
    stop = stop or StopSignal()
    say = log or (lambda line: None)
    options = prepare_options(options)
    started = time.monotonic()
    started_at = _utc_now()
    # This process runs with the remote-cache switches nodes get (two are in torch's keys):
    # its prewarm/verify children inherit them, and its fingerprint records them.
    offer = client.remote_cache()
    remote_tier.set_builder_switches(os.environ, {} if offer is None else offer.switches)
    fingerprint = collect()
    digest = digest_of(fingerprint)
    changed = previous_digest is not None and previous_digest != digest
    agent = client.register_agent(
        name=options.name,
        fingerprint=fingerprint,
        fingerprint_digest=digest,
        devices=list(options.devices),
        gpus=[dict(gpu) for gpu in fingerprint["gpus"]],
        version=config.package_version(),
    )
    agent_id = agent.id
    note = " (environment changed: building for the new fingerprint)" if changed else ""
    say(
        f"agent {options.name} [{agent_id}] fingerprint {digest[:12]} on"
        f" {','.join(options.devices)}{note}"
    )
    workloads = sorted(client.list_workloads(), key=lambda w: w.name)
    # A signing agent trusts its own key only: what it did not sign is not warm for it.
    own_key = None if options.sign_key is None else public_key_of(options.sign_key)
    builder = KeepWarm(
        options=options,
        client=client,
        stop=stop,
        say=say,
        agent_id=agent_id,
        fingerprint=fingerprint,
        digest=digest,
        memory=memory or AgentMemory(),
        own_key=own_key,
    )
    outcomes: list[WorkloadOutcome] = []
    for entry in workloads:
        if stop.is_set():
            break
        outcome = builder.keep_warm(entry.name)
        outcomes.append(outcome)
        if outcome.abandoned:
            break
    return RoundReport(
        agent_id=agent_id,
        name=options.name,
        fingerprint_digest=digest,
        fingerprint_changed=changed,
        devices=tuple(options.devices),
        started_at=started_at,
        seconds=round(time.monotonic() - started, 3),
        outcomes=tuple(outcomes),
        stopped=stop.is_set(),
    )


def run_agent(
    options: AgentOptions,
    *,
    client: CacheClient,
    interval_s: float,
    once: bool = False,
    stop: StopSignal | None = None,
    log: Log | None = None,
    on_round: Callable[[RoundReport], None] | None = None,
    keep_reports: int = KEEP_REPORTS,
) -> list[RoundReport]:
    """Run rounds every ``interval_s`` until ``stop`` (or one round with ``once``).

    With ``once``, a round that cannot reach the server raises; the daemon logs it and
    tries again next interval. Returns the last ``keep_reports`` rounds' reports (a daemon
    runs for months: every round goes to ``on_round``, and only these stay in memory).
    """
    stop = stop or StopSignal()
    say = log or (lambda line: None)
    options = prepare_options(options, log=say)  # the key is read here, before any build
    hidden = options.confinement.hidden
    if hidden:
        say(f"builds cannot read {', '.join(map(str, hidden))} (Landlock)")
    removed = sweep_stale_builds(options.work_dir)
    if removed:
        say(f"removed {len(removed)} build dir(s) a previous agent left in {options.work_dir}")
    reports: collections.deque[RoundReport] = collections.deque(maxlen=max(1, keep_reports))
    previous: str | None = None
    memory = AgentMemory()
    while not stop.is_set():
        try:
            report = run_round(
                options,
                client=client,
                stop=stop,
                log=say,
                previous_digest=previous,
                memory=memory,
            )
        except CachekeeperError as exc:
            if once:
                raise
            say(f"round failed: {exc.detail} [{exc.code}]; next try in {interval_s:g} s")
        else:
            previous = report.fingerprint_digest
            reports.append(report)
            if on_round is not None:
                on_round(report)
            if once:
                if not report.all_reported and not report.stopped:
                    raise ServerUnavailable(
                        "the server stopped answering: some outcomes were not reported"
                    )
                break
        stop.sleep(interval_s)
    return list(reports)
