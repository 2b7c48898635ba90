"""The builder agent: keep every registered workload warm for this node's environment.

One round (``run_round``):

1. Collect the fingerprint again (a torch, Triton, CUDA wheel or driver upgrade changes its
   digest) and register with the server; the agent is one per name (its id is its name's),
   so registering is idempotent and a changed environment updates the same agent.
2. List the registered workloads. For each, in name order: ask the server to resolve it
   for the fingerprint its build compiles under (the agent's, with the CPU state of the
   workload's ``[process] omp_num_threads``: what the snapshot carries and the workload's
   events name) and these devices. A *verified* snapshot built from the same
   workload text counts as warm: report ``skipped`` and compile nothing. A signing agent
   (``--sign-key``) asks with its own public key as the node's trust (resolve's
   ``trusted_keys``) and checks the answer's signature itself: a snapshot its own key did
   not sign, or whose "verified" its key did not sign, is not warm. Otherwise build:
   report ``building``, prewarm on every selected device (one fresh process per device,
   cold, then a verify run; each ``[[command]]`` once cold, then again in a fresh copy),
   push only when verified, and report ``built``, ``cold_compile_broken`` (with the
   traceback tail) or ``failed``. One workload's crash or timeout never stops the others.
3. Code runs only when this builder's operator allowed it (``cachekeeper.allowlist``,
   ``agent --allow`` / ``--allow-file``): a workload whose command (program, arguments,
   env, cwd) or import path no entry admits is reported ``refused`` with why and what to
   allow, and nothing of it runs. Every process of a build runs under a supervisor that
   reaps its whole tree (``cachekeeper.confine``); an import path must name a def or class
   of its module; with ``--sign-key`` the key is read once, before any build, and hidden
   from every build's processes (``cachekeeper.landlock``): a host that cannot hide it is
   refused at start (``BuildsUnconfined``) unless the operator passed ``--unconfined-builds``.
4. Promotion, under the rule that **a builder signs only bytes it compiled itself in
   that round; a harvest is at most a hint of what to compile** (``cachekeeper.harvest``):
   a warm workload with a ``[[command]]`` whose snapshot has harvested deltas
   (``postjob --push`` from training nodes, same fingerprint digest) is built again, cold,
   in a fresh empty dir, like any build; no delta is ever restored or loaded here, only
   their manifests are read. When its own run compiled harvested entries the snapshot
   lacks, its own build is pushed (signed, verified) and reported ``built`` saying how
   many; the rest are kept back with why, and nothing is published when none was
   compiled here (``skipped``). A set of deltas is judged once per agent process.

Each build happens in a folder this agent creates and always removes, so the work dir
never fills the disk::

    <work_dir>/build-<workload>-XXXX/
      .cachekeeper-agent-build      # marker: "this agent made it" (pid inside)
      inductor/                     # the staging TORCHINDUCTOR_CACHE_DIR prewarm fills
      .cachekeeper-prewarm-XXXX/    # prewarm's own work area (it removes it)
      store/                        # the local blob store push snapshots into

Folders with the marker whose pid is gone (an agent killed with SIGKILL) are removed at
the next start; nothing without the marker is ever touched.

Stopping (``StopSignal``): SIGTERM/SIGINT set a flag. Between rounds the agent wakes at
once. During a build the signal abandons it: the exception raised in the main thread
unwinds prewarm, whose ``finally`` kills every child process group, and the push, whose
publish is its last request, so no half-pushed snapshot is ever published. The abandoned
build is reported as ``failed`` and the agent returns cleanly.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, cast

from cachekeeper import config, landlock, remote_tier, wire
from cachekeeper._proc import pid_alive
from cachekeeper.allowlist import Allowlist
from cachekeeper.children import child_cpu_state
from cachekeeper.confine import Confinement
from cachekeeper.devices import format_devices
from cachekeeper.errors import BuildsUnconfined, CachekeeperError, ServerUnavailable
from cachekeeper.fingerprint import CpuState, Fingerprint, collect, digest_of, with_cpu
from cachekeeper.harvest import HarvestJudgement, judge
from cachekeeper.manifest import Manifest
from cachekeeper.prewarm import prewarm
from cachekeeper.provenance import load_prewarm_record, recorded_cpu
from cachekeeper.scan import scan_dir
from cachekeeper.signing import SigningKey, TrustedKey, public_key_of, signature_problem
from cachekeeper.store import LocalStore
from cachekeeper.verdicts import CommandRun, DeviceRun
from cachekeeper.workload import Workload, parse_workload

from .push import push

if TYPE_CHECKING:
    from cachekeeper.client.api import CacheClient, Resolution
    from cachekeeper.verdicts import PrewarmReport, ProgressEvent

__all__ = [
    "DEFAULT_BUILD_TIMEOUT_S",
    "AgentMemory",
    "AgentOptions",
    "AgentStopped",
    "RoundReport",
    "StopSignal",
    "WorkloadOutcome",
    "prepare_options",
    "run_agent",
    "run_round",
    "sweep_stale_builds",
]

OutcomeStatus = Literal["built", "skipped", "cold_compile_broken", "failed", "refused"]
Log = Callable[[str], None]

MARKER = ".cachekeeper-agent-build"
_TAIL_LINES = 20
_TAIL_LINE_CHARS = 500
_DETAIL_CHARS = 4000
KEEP_REPORTS = 16  # round reports run_agent keeps in memory (the newest)
# A build's default bound (``agent --build-timeout``): a cold compile of a real workload
# takes minutes (torchtitan's flex_attention with max-autotune, the most expensive we
# measured, 69 s per regime), so an hour per child is far past any honest build and ends
# one that a registered workload made endless (100,000 sequence lengths kept an agent busy).
DEFAULT_BUILD_TIMEOUT_S = 3600.0


class AgentStopped(BaseException):
    """Raised in the main thread by a stop signal to abandon a build or a wait.

    A BaseException, so that no ``except Exception`` on the way up swallows it.
    """


class StopSignal:
    """A stop request: set by SIGTERM/SIGINT (``install``) or by ``set()`` from any thread.

    Inside ``abandonable()`` (main thread), a signal also raises ``AgentStopped`` at once.
    ``set()`` from another thread only stops the agent between workloads and rounds.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._signalled = False  # set by the handler: no locks in a signal handler
        self._depth = 0
        self._raised = False

    def is_set(self) -> bool:
        return self._signalled or self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this (the main) thread."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True
        # Raise once only: a second signal must not interrupt the unwinding of the first
        # (prewarm's ``finally`` that kills the children).
        if self._depth > 0 and not self._raised:
            self._raised = True
            raise AgentStopped(signal.Signals(signum).name)

    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        """A block a signal interrupts (raising AgentStopped) instead of waiting for."""
        self._depth += 1
        try:
            if self.is_set():
                raise AgentStopped("stop requested")
            yield
        finally:
            self._depth -= 1

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less if a stop comes (returns, never raises)."""
        try:
            with self.abandonable():
                self._event.wait(seconds)
        except AgentStopped:
            pass


@dataclass(frozen=True)
class AgentOptions:
    """What the agent builds, where, and for how long (``cachekeeper agent``'s options)."""

    devices: tuple[str, ...]
    work_dir: Path
    name: str = field(default_factory=socket.gethostname)
    # Each prewarm or verify child, and each command run, is killed past this (a command's
    # own ``timeout`` wins when shorter); the build is then reported ``failed``, "timeout".
    build_timeout_s: float | None = DEFAULT_BUILD_TIMEOUT_S
    push_workers: int = 4
    heartbeat_s: float = 60.0  # heartbeats while a build runs
    sign_key: Path | SigningKey | None = None  # Ed25519 PREFIX.key: every push is signed
    allow: Allowlist = field(default_factory=Allowlist)  # the code this builder may run
    unconfined: bool = False  # sign even where builds cannot be kept from the key

    @property
    def confinement(self) -> Confinement:
        """What every process of a build is held to: reaped; an import path defined in its
        module; the signing key hidden where this host can (``prepare_options`` refused
        the rest unless ``unconfined``)."""
        hidden: tuple[Path, ...] = ()
        if self.sign_key is not None and landlock.unavailable_reason() is None:
            hidden = (Path(self.sign_key).absolute(),)
        return Confinement(hidden=hidden, defined_imports=True)


def prepare_options(options: AgentOptions, *, log: Log | None = None) -> AgentOptions:
    """Read the signing key into memory (before any build runs), and refuse to sign where
    a build could read it: BuildsUnconfined, unless ``options.unconfined`` (then a warning).

    Idempotent: a key already read is not read again.
    """
    key = options.sign_key
    if key is None:
        return options
    if not isinstance(key, SigningKey):
        key = SigningKey.load(Path(key).absolute())
    problem = landlock.unavailable_reason() or landlock.hidden_file_problem(key.path)
    if problem is not None and not options.allow.empty:
        message = (
            f"--sign-key {key.path}: builds run admitted code, and this builder cannot keep"
            f" the key from it: {problem}"
        )
        if not options.unconfined:
            raise BuildsUnconfined(
                message + "; sign elsewhere, run the agent where Landlock works (Linux >= 5.19),"
                " or pass --unconfined-builds to accept that the code you admit can read it"
            )
        if log is not None:
            log(f"warning: {message} (--unconfined-builds)")
    return replace(options, sign_key=key)


@dataclass
class AgentMemory:
    """What an agent process remembers between rounds: the harvests it judged (the warm
    snapshot's id and its deltas' ids), so that each set costs one build."""

    judged_harvests: set[tuple[str, frozenset[str]]] = field(default_factory=set)


@dataclass(frozen=True)
class WorkloadOutcome:
    """What one round did for one workload, and whether the server heard about it."""

    workload: str
    status: OutcomeStatus
    fingerprint_digest: str
    prewarm_ran: bool
    seconds: float
    snapshot_id: str | None = None
    detail: str = ""
    traceback_tail: tuple[str, ...] = ()
    reported: bool = False
    abandoned: bool = False
    prewarm: dict[str, Any] | None = None  # PrewarmReport.to_dict() when a prewarm ran

    def to_dict(self) -> dict[str, Any]:
        return wire.to_dict(self)


@dataclass(frozen=True)
class RoundReport:
    """One round: the environment it ran for and each workload's outcome."""

    agent_id: str
    name: str
    fingerprint_digest: str
    fingerprint_changed: bool  # the digest differs from the previous round's
    devices: tuple[str, ...]
    started_at: str
    seconds: float
    outcomes: tuple[WorkloadOutcome, ...]
    stopped: bool  # a stop request ended the round early

    @property
    def prewarms_run(self) -> int:
        return sum(o.prewarm_ran for o in self.outcomes)

    @property
    def all_reported(self) -> bool:
        """Every outcome reached the server (the ``--once`` success condition)."""
        return all(o.reported for o in self.outcomes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "agent_id": self.agent_id,
            "name": self.name,
            "fingerprint_digest": self.fingerprint_digest,
            "fingerprint_changed": self.fingerprint_changed,
            "devices": list(self.devices),
            "started_at": self.started_at,
            "seconds": self.seconds,
            "stopped": self.stopped,
            "prewarms_run": self.prewarms_run,
            "all_reported": self.all_reported,
            "outcomes": [o.to_dict() for o in self.outcomes],
        }


def _utc_now() -> str:
    # Not wire.utc_now: a round's started_at is `agent --json` output, in whole seconds.
    return datetime.now(UTC).isoformat(timespec="seconds")


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


# -- one round ------------------------------------------------------------------------------


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
    builder = _Builder(
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


class _Builder:
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
        where = ",".join(self.options.devices) if workload.regimes or workload.entrypoints else ""
        commands = f"{len(workload.commands)} command(s)" if workload.commands else ""
        self.say(f"{name}: building on {' and '.join(x for x in (where, commands) if x)}")
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
        if workload.commands and (found.snapshot_id is None or not found.verified):
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
        if not workload.commands:
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
                if workload.commands:  # its processes' CPU state: the snapshot's, the events'
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
                else f"{timed_out.mode} of command[{timed_out.index}]"
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


# -- the daemon -----------------------------------------------------------------------------


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
