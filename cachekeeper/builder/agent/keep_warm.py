"""One round's work for one workload: resolve, then skip, promote a harvest, refuse or
build, then report (``KeepWarm``); and the build folders it makes and always removes.

Each build happens in a folder this agent creates and always removes, so the work dir
never fills the disk::

    <work_dir>/build-<workload>-XXXX/
      .cachekeeper-agent-build      # marker: "this agent made it" (pid inside)
      inductor/                     # the staging TORCHINDUCTOR_CACHE_DIR prewarm fills
      .cachekeeper-prewarm-XXXX/    # prewarm's own work area (it removes it)
      store/                        # the local blob store push snapshots into

Folders with the marker whose pid is gone (an agent killed with SIGKILL) are removed at
the next start (``sweep_stale_builds``); nothing without the marker is ever touched.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from cachekeeper._proc import pid_alive
from cachekeeper.builder.agent.options import AgentMemory, AgentOptions, Log
from cachekeeper.builder.agent.outcomes import OutcomeStatus, WorkloadOutcome
from cachekeeper.builder.agent.stop import AgentStopped, StopSignal
from cachekeeper.builder.children import child_cpu_state
from cachekeeper.builder.harvest import HarvestJudgement, judge
from cachekeeper.builder.prewarm import prewarm
from cachekeeper.builder.verdicts import CommandRun, DeviceRun
from cachekeeper.builder.workload import Workload, parse_workload
from cachekeeper.client.push import push
from cachekeeper.environment.devices import format_devices
from cachekeeper.environment.fingerprint import CpuState, Fingerprint, digest_of, with_cpu
from cachekeeper.errors import CachekeeperError
from cachekeeper.snapshot.manifest import Manifest
from cachekeeper.snapshot.provenance import load_prewarm_record, recorded_cpu
from cachekeeper.snapshot.scan import scan_dir
from cachekeeper.snapshot.signing import TrustedKey, signature_problem
from cachekeeper.store import LocalStore

if TYPE_CHECKING:
    from cachekeeper.builder.verdicts import PrewarmReport, ProgressEvent
    from cachekeeper.client.api import CacheClient, Resolution

__all__ = ["MARKER", "KeepWarm", "sweep_stale_builds"]

MARKER = ".cachekeeper-agent-build"
_TAIL_LINES = 20
_TAIL_LINE_CHARS = 500
_DETAIL_CHARS = 4000


def sweep_stale_builds(work_dir: Path) -> list[Path]:
    """Remove build folders an agent left behind (marker present, its pid gone)."""
    removed: list[Path] = []
    if not work_dir.is_dir():
        return removed
    for path in sorted(work_dir.glob("build-*")):
        marker = path / MARKER
        try:
            pid = int(marker.read_text("utf-8").strip())
        except (OSError, ValueError):
            continue  # not ours: never touched
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class KeepWarm:
    """One round's per-workload work: resolve, then skip or build, then report."""

    def __init__(
        self,
        *,
        options: AgentOptions,
        client: CacheClient,
        stop: StopSignal,
        say: Log,
        agent_id: str,
        fingerprint: Fingerprint,
        digest: str,
        memory: AgentMemory,
        own_key: TrustedKey | None = None,
    ) -> None:
        self.options = options
        self.own_key = own_key
        self.memory = memory
        self.client = client
        self.stop = stop
        self.say = say
        self.agent_id = agent_id
        self.fingerprint = fingerprint
        self.digest = digest
        # The agent's own environment; per workload, what its build compiles under
        # (``_built_with``): the fingerprint its resolve asks with, its snapshot carries
        # and its events name.
        self.agent_fingerprint, self.agent_digest = fingerprint, digest

    def _built_with(self, workload: Any, cpu_state: CpuState | None = None) -> None:
        """Take the fingerprint of what a build of ``workload`` compiles: the agent's, with
        the CPU state of its children (its ``[process] omp_num_threads``), or ``cpu_state``
        (what a command's processes compiled under: its launcher decides)."""
        if cpu_state is None:
            cpu_state = child_cpu_state(workload.omp_num_threads)
        self.fingerprint = with_cpu(self.agent_fingerprint, cpu_state)
        self.digest = digest_of(self.fingerprint)

    def keep_warm(self, name: str) -> WorkloadOutcome:
        started = time.monotonic()
        self.fingerprint, self.digest = self.agent_fingerprint, self.agent_digest
        try:
            outcome = self._skip_or_build(name, started)
        except AgentStopped:
            outcome = self._outcome(
                name,
                "failed",
                started,
                prewarm_ran=True,
                detail="abandoned: the agent was asked to stop during the build",
                abandoned=True,
            )
        except CachekeeperError as exc:
            outcome = self._outcome(
                name, "failed", started, prewarm_ran=False, detail=f"{exc.code}: {exc.detail}"
            )
        return self._report(outcome)

    def _skip_or_build(self, name: str, started: float) -> WorkloadOutcome:
        workload = parse_workload(self.client.get_workload(name), source=f"{name} (server)")
        self._built_with(workload)
        warm = self._warm_snapshot(workload)
        if warm is not None:
            promoted = self._promote_harvests(workload, warm, started)
            if promoted is not None:
                return promoted
            self.say(f"{name}: warm (snapshot {warm.id[:12]}), nothing to compile")
            return self._outcome(name, "skipped", started, prewarm_ran=False, snapshot_id=warm.id)
        refused = self.options.allow.refused(workload)
        if refused:
            detail = self.options.allow.explain(refused)
            self.say(f"{name}: {detail}")
            return self._outcome(name, "refused", started, prewarm_ran=False, detail=detail)
        self._send_event(name, status="building")
        where = ",".join(self.options.devices) if workload.device_tables else ""
        own = collections.Counter(t.kind.table for t in workload.process_tables)
        counts = [f"{count} {table}(s)" for table, count in own.items()]  # "1 command(s)"
        self.say(f"{name}: building on {' and '.join(x for x in (where, *counts) if x)}")
        return self._build(workload, started)

    def _resolve(self, name: str) -> Resolution:
        """The server's answer for this build's fingerprint; a signing agent's own key is
        its trust, so the server ranks only what that key signed."""
        return self.client.resolve(
            self.fingerprint,
            workload=name,
            devices=list(self.options.devices),
            trusted_keys=None if self.own_key is None else [self.own_key],
        )

    def _warm_snapshot(self, workload: Workload) -> Manifest | None:
        """The manifest of a verified snapshot of this very workload text for us (signed by
        our own key, for a signing agent), or None.

        A command's processes compile under the CPU state their launcher gives them
        (torchrun: one thread per rank), which the agent cannot know before it ran them:
        when the only difference from a verified snapshot is ``cpu``, that snapshot's is
        taken (it was built here, by this workload's command) and asked again.
        """
        name = workload.name
        found = self._resolve(name)
        if workload.process_tables and (found.snapshot_id is None or not found.verified):
            near = next(
                (
                    n
                    for n in found.near_misses
                    if n.snapshot.verified and [m.field for m in n.mismatches] == ["cpu"]
                ),
                None,
            )
            if near is not None and isinstance(near.mismatches[0].snapshot, dict):
                # the cpu field of a manifest the server took (fingerprint.parse checked it)
                self._built_with(workload, cast(CpuState, near.mismatches[0].snapshot))
                found = self._resolve(name)
        if found.snapshot_id is None or not found.verified:
            return None
        manifest = self.client.get_manifest(found.snapshot_id)
        if self.own_key is not None:
            # The server checked it; so do we: a server that ignores trusted_keys (older
            # than issue 32) or lies must not make us skip a build.
            problem = signature_problem(manifest, [self.own_key])
            if problem is not None or not manifest.verified:
                why = problem or "its verified claim is not one our key signed"
                self.say(f"{name}: snapshot {found.snapshot_id[:12]} is not ours ({why})")
                return None
        if manifest.workload_digest not in (None, workload.digest):
            self.say(f"{name}: the workload changed since snapshot {found.snapshot_id[:12]}")
            return None
        return manifest

    def _promote_harvests(
        self, workload: Workload, warm: Manifest, started: float
    ) -> WorkloadOutcome | None:
        """Build the workload again when its warm snapshot has harvested deltas (module
        docstring, 4): the harvest is a hint, never bytes we load. None when there is
        nothing to judge (the warm snapshot serves)."""
        if not workload.process_tables:
            return None
        name = workload.name
        deltas = tuple(
            s
            for s in self.client.list_snapshots(
                workload=name, fingerprint_digest=warm.fingerprint_digest, verified=False
            )
            if s.source == "harvest" and s.parent == warm.id
        )
        key = (warm.id, frozenset(d.id for d in deltas))
        if not deltas or key in self.memory.judged_harvests:
            return None
        refused = self.options.allow.refused(workload)
        if refused:
            self.say(f"{name}: harvested deltas not judged: {self.options.allow.explain(refused)}")
            return None
        self.memory.judged_harvests.add(key)
        try:  # their manifests only (JSON, validated): no blob of a harvest reaches us
            manifests = [self.client.get_manifest(d.id) for d in deltas]
        except CachekeeperError as exc:
            self.say(f"{name}: harvested deltas not judged: {exc.detail}")
            return None
        self._send_event(name, status="building")
        self.say(
            f"{name}: {len(deltas)} harvested delta(s) of {warm.id[:12]}: building the"
            " workload again in a fresh dir (a harvest is a hint: its bytes are never loaded)"
        )
        outcome = self._build(workload, started, harvest=(warm, manifests))
        if outcome.status in ("built", "skipped"):
            return outcome
        self.say(f"{name}: the build failed ({outcome.detail}); the snapshot still serves")
        return self._outcome(
            name,
            "skipped",
            started,
            prewarm_ran=True,
            snapshot_id=warm.id,
            detail=f"harvested deltas not judged: the build failed: {outcome.detail}",
            prewarm=outcome.prewarm,
        )

    def _build(
        self,
        workload: Workload,
        started: float,
        *,
        harvest: tuple[Manifest, list[Manifest]] | None = None,
    ) -> WorkloadOutcome:
        """Prewarm ``workload`` in a fresh, empty build dir and push it when verified.

        With ``harvest`` (the warm snapshot and its deltas' manifests), the build is pushed
        only when it compiled harvested entries the snapshot lacks (``harvest.judge``);
        otherwise the outcome is ``skipped`` with what was kept back and why. Nothing but
        this build's own compile ever enters the dir.
        """
        name = workload.name
        work_dir = self.options.work_dir
        work_dir.mkdir(parents=True, exist_ok=True)
        build_dir = Path(tempfile.mkdtemp(prefix=f"build-{name}-", dir=work_dir))
        judged: HarvestJudgement | None = None
        try:
            (build_dir / MARKER).write_text(str(os.getpid()), encoding="utf-8")
            cache_dir = build_dir / "inductor"
            with self._heartbeats(), self.stop.abandonable():
                report = prewarm(
                    workload,
                    cache_dir,
                    devices=list(self.options.devices),
                    progress=self._progress,
                    timeout_s=self.options.build_timeout_s,
                    confinement=self.options.confinement,
                )
                if report.status != "verified":
                    return self._unbuilt(name, report, started)
                if harvest is not None:
                    warm, deltas = harvest
                    built = [rel for rel, _path, _mode in scan_dir(cache_dir)]
                    judged = judge(warm=warm, deltas=deltas, built=built)
                    if not judged.publishes:
                        self.say(f"{name}: {judged.describe()}")
                        return self._outcome(
                            name,
                            "skipped",
                            started,
                            prewarm_ran=True,
                            snapshot_id=warm.id,
                            detail=judged.describe(),
                            prewarm=report.to_dict(),
                        )
                if workload.process_tables:  # their CPU state: the snapshot's, the events'
                    compiled_under = recorded_cpu(load_prewarm_record(cache_dir, name))
                    if compiled_under is not None:
                        self._built_with(workload, compiled_under)
                self.say(f"{name}: verified; pushing")
                pushed = push(
                    cache_dir,
                    client=self.client,
                    workload=name,
                    store=LocalStore(home=build_dir / "store"),
                    workers=self.options.push_workers,
                    fingerprint=self.fingerprint,
                    sign_key=self.options.sign_key,
                )
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
        self.say(
            f"{name}: built snapshot {pushed.snapshot_id[:12]} covering"
            f" {format_devices(list(report.covered_devices))} in {report.seconds:.1f} s"
            f" ({pushed.uploaded_blobs} blobs uploaded, {pushed.deduplicated_blobs} deduplicated)"
        )
        return self._outcome(
            name,
            "built",
            started,
            prewarm_ran=True,
            snapshot_id=pushed.snapshot_id,
            detail="" if judged is None else judged.describe(),
            prewarm=report.to_dict(),
        )

    @contextlib.contextmanager
    def _heartbeats(self) -> Iterator[None]:
        """Heartbeat from a thread while a (long) build runs; failures are ignored."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.options.heartbeat_s):
                with contextlib.suppress(CachekeeperError):
                    self.client.heartbeat(self.agent_id)

        thread = threading.Thread(target=beat, name="cachekeeper-agent-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()

    def _unbuilt(self, name: str, report: PrewarmReport, started: float) -> WorkloadOutcome:
        """The outcome of a prewarm that did not prove a cache (nothing is pushed)."""
        runs: list[Any] = [*report.devices, *report.commands]
        if report.verify is not None:
            runs += [*report.verify.devices, *report.verify.commands]
        error = report.error or next((r.error for r in runs if r.error), None)
        timed_out = next((r for r in runs if r.status == "timeout"), None)
        if report.status == "not_effective":
            reasons = report.verify.reasons if report.verify is not None else []
            detail = "verify was not effective: " + (
                "; ".join(reasons) if reasons else "the second run still missed the cache"
            )
        elif timed_out is not None:
            error = timed_out.error or error
            what = (
                f"{timed_out.mode} on {timed_out.device}"
                if isinstance(timed_out, DeviceRun)
                else f"{timed_out.mode} of {timed_out.name}"
            )
            bound = self.options.build_timeout_s
            limit = "no build timeout" if bound is None else f"--build-timeout {bound:g} s"
            own = " or the command's own timeout" if isinstance(timed_out, CommandRun) else ""
            said = error.message if error is not None else "killed"
            detail = f"timeout: {what}: {said} (the agent's {limit}{own})"
        elif error is not None:
            where = f" ({error.where})" if error.where else ""
            detail = f"{error.type}: {error.message}{where}"
        else:
            detail = f"prewarm {report.status}"
        status: OutcomeStatus = (
            "cold_compile_broken" if report.status == "cold_compile_broken" else "failed"
        )
        self.say(f"{name}: {status}: {detail}")
        return self._outcome(
            name,
            status,
            started,
            prewarm_ran=True,
            detail=detail,
            traceback_tail=error.traceback_tail if error else (),
            prewarm=report.to_dict(),
        )

    def _progress(self, event: ProgressEvent) -> None:
        self.say(f"  {event.describe()}")

    def _outcome(
        self,
        name: str,
        status: OutcomeStatus,
        started: float,
        *,
        prewarm_ran: bool,
        snapshot_id: str | None = None,
        detail: str = "",
        traceback_tail: tuple[str, ...] = (),
        abandoned: bool = False,
        prewarm: dict[str, Any] | None = None,
    ) -> WorkloadOutcome:
        return WorkloadOutcome(
            workload=name,
            status=status,
            fingerprint_digest=self.digest,
            prewarm_ran=prewarm_ran,
            seconds=round(time.monotonic() - started, 3),
            snapshot_id=snapshot_id,
            detail=detail[:_DETAIL_CHARS],
            traceback_tail=tuple(line[:_TAIL_LINE_CHARS] for line in traceback_tail[-_TAIL_LINES:]),
            abandoned=abandoned,
            prewarm=prewarm,
        )

    def _report(self, outcome: WorkloadOutcome) -> WorkloadOutcome:
        sent = self._send_event(
            outcome.workload,
            status=outcome.status,
            detail=outcome.detail,
            traceback_tail=outcome.traceback_tail,
            snapshot_id=outcome.snapshot_id,
            seconds=outcome.seconds,
        )
        return replace(outcome, reported=sent)

    def _send_event(self, name: str, **fields: Any) -> bool:
        """Report to the server; False (and a log line) when it cannot be reached."""
        try:
            self.client.report_event(
                self.agent_id, workload=name, fingerprint_digest=self.digest, **fields
            )
        except CachekeeperError as exc:
            self.say(f"{name}: could not report {fields['status']!r}: {exc.detail}")
            return False
        return True
