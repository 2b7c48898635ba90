"""The pre-job hook: restore this node's cache before training starts, never block the job.

    eval "$(cachekeeper prejob --workload drafter-gqa)"

1. Fingerprint this node (no torch import) and pick the cache dir: ``--cache-dir``, else
   ``$TORCHINDUCTOR_CACHE_DIR``, else a persistent per-environment dir::

       $CACHEKEEPER_HOME (default ~/.cache/cachekeeper)/
         inductor/
           <fingerprint digest[:16]>/      # TORCHINDUCTOR_CACHE_DIR for this environment

   (not ``/tmp``, which many hosts wipe on reboot; one dir per fingerprint, so a new torch
   build never writes into another build's cache).
2. Resolve the workload with the fingerprint (and, with a trust list, the public keys it
   trusts: the server then answers only a snapshot whose signature it checked against
   them, so an unsigned publish cannot shadow the signed one). If the dir already holds
   that snapshot (the restore's own check, ``cachekeeper.restore.marker.is_restored``: a
   marker and a stat), stop: this is the common, fast path. It asks with one plain ``http.client`` request,
   because importing httpx alone costs about 130 ms of the 300 ms budget, and it loads
   neither the HTTP client nor the restore stack.
3. Otherwise ``cachekeeper.client.pull.pull`` with that answer (a miss, or a restore
   due: the server is asked once per job start), or, when the quick request failed,
   with none, so that ``CacheClient`` resolves again (it retries, maps errors and
   explains). Then the one restore, which takes the dir's lock (other ranks of this node
   wait on it), checks again, and fetches only the blobs the dir lacks, in one archive
   stream.

4. The per-key tier (``client/tier.py``): when the server offers it (resolve's
   ``remote_cache``), the exports also carry torch's remote-cache switches and the tier's
   URL with this node's token, after a one-second probe of its port; snapshots stay the
   first tier (restored files are local hits, the tier is asked only for what they lack).


The deadline (``timeout_s``) is a promise: the hook returns within it and a moment
(``JOIN_SLACK_S``), and its process can exit then, under every fault. The fingerprint runs
inside it (a hung NVML or ``nvidia-smi`` gets what is left, then the start is cold); the
work runs in a daemon thread that the hook stops waiting for at the deadline, so a stuck
filesystem or server cannot hold the job; every request inside is bounded in wall time
and in the bytes it reads (``transport.post_json``, ``CacheClient``), and the object
store's downloads run in daemon threads (``cachekeeper.daemon_pool``) that never keep the
process alive. The report gets what is left of the deadline, at most ``REPORT_TIMEOUT_S``.

Whatever goes wrong, the outcome is ``cold`` with a one-line reason, and the exports are
still printed; only ``--strict`` turns that into a non-zero exit. A restore abandoned
half-way leaves only complete, verified files (the restore rules). One export is never
printed: a cache dir the hook cannot write in (a file, a read-only mount), proved by
writing there (``fsutil.unwritable_dir``), since a job given an unwritable
``TORCHINDUCTOR_CACHE_DIR`` crashes; torch's default dir is better than that.
"""

from __future__ import annotations

import json
import os
import shlex
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from cachekeeper import config, remote_tier
from cachekeeper.environment.fingerprint import GPU_TIMEOUT_S, Fingerprint, collect, digest_of
from cachekeeper.errors import (
    CacheDirUnusable,
    CachekeeperError,
    FingerprintUnavailable,
    Forbidden,
    NoMatchingSnapshot,
    ServerError,
    ServerUnavailable,
    SignatureInvalid,
    Unauthorized,
)
from cachekeeper.fsutil import atomic_write_secret, unwritable_dir
from cachekeeper.restore.marker import held_snapshot, is_restored
from cachekeeper.snapshot.signing import load_trusted_keys
from cachekeeper.wire import (
    JobReport,
    RemoteCacheOffer,
    ResolveAnswer,
    ResolveRequest,
    from_dict,
    to_dict,
)

from .calls import Deadline
from .job_reports import job_id, node_name, send_report, utc_now
from .tier import PROBE_TIMEOUT_S, tier_exports
from .tier_stats import prepare as prepare_tier_stats
from .tier_stats import stats_dir as tier_stats_dir
from .transport import post_json

REPORT_TIMEOUT_S = 2.0  # the most a report may add to the hook (it is best-effort)
JOIN_SLACK_S = 0.1  # how long past the deadline the hook waits for its worker

__all__ = [
    "PrejobReport",
    "prejob",
    "default_cache_dir",
    "export_lines",
    "write_env_file",
    "cold_line",
]


@dataclass(frozen=True)
class PrejobReport:
    """What the hook did. ``outcome``: "restored", "already_restored" or "cold"."""

    workload: str
    cache_dir: str
    outcome: str
    exports: dict[str, str]
    elapsed_s: float
    snapshot_id: str | None = None
    blobs_fetched: int = 0
    reason: str | None = None  # why the job compiles cold; None otherwise
    error: CachekeeperError | None = field(default=None, repr=False, compare=False)
    reported: bool = False  # the server stored this outcome (POST /v1/reports)
    deltas: tuple[str, ...] = ()  # harvested deltas restored after the snapshot
    delta_problems: tuple[str, ...] = ()  # deltas not restored, one line each (why)
    # The per-key tier: "on" (the job uses it), "off" (offered, not used: remote_cache_reason
    # says why), None (the server offers none).
    remote_cache: str | None = None
    remote_cache_reason: str | None = None
    # With the tier on: the path ("cachekeeper": our backend, "redis": torch's stock
    # path), whether the job writes, and prejob's line saying so.
    remote_cache_backend: str | None = None
    remote_cache_writes: bool = False
    remote_cache_note: str | None = None
    # Cold because the server gave no answer, but an earlier restore's snapshot is still
    # complete in the dir: the job uses it (``cold_line`` says so).
    held_snapshot_id: str | None = None
    # Files of the snapshot found in the dir with other bytes, kept as they were (a file
    # changed since a restore is no longer "already restored": this is where it shows).
    conflicts: tuple[str, ...] = ()

    @property
    def cold(self) -> bool:
        return self.outcome == "cold"

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "cache_dir": self.cache_dir,
            "outcome": self.outcome,
            "exports": dict(self.exports),
            "elapsed_s": round(self.elapsed_s, 4),
            "snapshot_id": self.snapshot_id,
            "blobs_fetched": self.blobs_fetched,
            "reason": self.reason,
            "error": None if self.error is None else self.error.code,
            "reported": self.reported,
            "deltas": list(self.deltas),
            "delta_problems": list(self.delta_problems),
            "remote_cache": self.remote_cache,
            "remote_cache_reason": self.remote_cache_reason,
            "remote_cache_backend": self.remote_cache_backend,
            "remote_cache_writes": self.remote_cache_writes,
            "remote_cache_note": self.remote_cache_note,
            "held_snapshot_id": self.held_snapshot_id,
            "conflicts": list(self.conflicts),
        }


def default_cache_dir(fingerprint_digest: str, *, environ: Mapping[str, str]) -> Path:
    """``$TORCHINDUCTOR_CACHE_DIR``, else the per-fingerprint dir under the cachekeeper home."""
    explicit = environ.get("TORCHINDUCTOR_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return config.node_cache_dir(fingerprint_digest, environ)


def export_lines(exports: Mapping[str, str]) -> str:
    """``export NAME=value`` lines, shell-quoted, for ``eval "$(cachekeeper prejob ...)"``."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in exports.items())


def write_env_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably (``cachekeeper.fsutil``'s rule),
    creating its folder. The file is ``0600`` from its creation (``atomic_write_secret``):
    its exports may carry the node's token (the per-key tier's URL)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_secret(path, text)


def cold_line(reason: str, *, held_snapshot_id: str | None = None) -> str:
    """The one stderr line a cold outcome prints (``held_snapshot_id``: the dir still holds
    an earlier restore, which the job uses)."""
    if held_snapshot_id is not None:
        return (
            f"cachekeeper: no cache restored ({reason}); the cache dir still holds snapshot"
            f" {held_snapshot_id[:12]} from an earlier restore, which this job will use"
            " (it may not be the newest)"
        )
    return f"cachekeeper: no cache restored ({reason}); this job will compile cold"


@dataclass
class _Outcome:
    """Filled in by the worker thread."""

    outcome: str = "cold"
    snapshot_id: str | None = None
    blobs_fetched: int = 0
    error: CachekeeperError | None = None
    deltas: tuple[str, ...] = ()
    delta_problems: tuple[str, ...] = ()
    offer: RemoteCacheOffer | None = None  # the per-key tier, from the quick answer
    conflicts: tuple[str, ...] = ()


def _work(
    result: _Outcome,
    *,
    server: str | None,
    token: str | None,
    workload: str,
    fingerprint: Fingerprint,
    cache_dir: Path,
    driver_policy: str,
    devices: list[str] | None,
    deadline: Any,
    timeout_s: float,
    trust: Sequence[str | os.PathLike[str]],
    remote_cache: str,
) -> None:
    try:
        # A trust file that cannot be read refuses every snapshot (a cold start saying so).
        trusted_keys = load_trusted_keys(trust)
        key_ids = {k.key_id for k in trusted_keys}

        quick = _quick_resolve(
            server,
            token=token,
            body=ResolveRequest(
                fingerprint=dict(fingerprint),  # the wire's JSON object
                workload=workload,
                driver_policy=cast(Any, driver_policy),  # the server refuses an unknown policy
                devices=devices,
                remote_cache=cast(Any, remote_cache),  # "auto", "on" or "off"
                # ranked by the server only among snapshots these keys signed (none: all)
                trusted_keys=[k.wire for k in trusted_keys] if trusted_keys else None,
            ),
            timeout_s=deadline.bound(timeout_s) / 2,  # leave the full client time to retry
        )
        # The tier's switches are in torch's keys: the snapshot was ranked for them, so they
        # are exported only with this answer (a resolve without it ranks without them).
        result.offer = None if quick is None else quick.remote_cache
        # The fast path: the restore's own already-restored check, on the quick answer
        # (the snapshot and every harvested delta the server offers after it).
        if quick is not None and quick.snapshot_id is not None:
            held = [quick.snapshot_id, *(d.id for d in quick.deltas)]
            if all(is_restored(i, cache_dir, trusted_key_ids=key_ids) for i in held):
                result.snapshot_id, result.outcome = quick.snapshot_id, "already_restored"
                return

        # Hook start-up: the HTTP client (httpx, every wire shape) and the restore stack
        # load only when a restore may be due, not on the no-op path.
        from .api import CacheClient
        from .pull import pull

        def resolved(snapshot_id: str) -> None:
            result.snapshot_id = snapshot_id

        with CacheClient(base_url=server or "", token=token, timeout_s=timeout_s) as client:
            done = pull(
                client=client,
                workload=workload,
                cache_dir=cache_dir,
                fingerprint=fingerprint,
                driver_policy=driver_policy,
                devices=devices,
                deadline=deadline,
                trusted_keys=trusted_keys,
                on_resolved=resolved,
                resolution=quick,  # asked once: a miss or a restore due is answered already
            )
        result.outcome, result.blobs_fetched = done.outcome, done.blobs_fetched
        result.deltas, result.delta_problems = done.deltas, done.delta_problems
        result.conflicts = done.conflicts
    except CachekeeperError as exc:
        result.error = exc
    except OSError as exc:  # an unwritable or full cache dir: the job still runs, cold
        result.error = CachekeeperError(f"cannot restore into {cache_dir}: {exc}")
    except Exception as exc:  # the hook must never fail the job on a bug
        result.error = CachekeeperError(f"unexpected {type(exc).__name__}: {exc}")


def _quick_resolve(
    server: str | None, *, token: str | None, body: ResolveRequest, timeout_s: float
) -> ResolveAnswer | None:
    """The answer of one stdlib POST /v1/resolve; None on any trouble."""
    answer = post_json(server, "/v1/resolve", to_dict(body), token=token, timeout_s=timeout_s)
    if answer is None or answer[0] != 200:
        return None
    try:
        return from_dict(ResolveAnswer, json.loads(answer[1]))
    except ValueError:  # WireError is a ValueError
        return None


def prejob(
    *,
    workload: str,
    server: str | None,
    token: str | None = None,
    cache_dir: Path | None = None,
    timeout_s: float = 60.0,
    driver_policy: str = "newer",
    devices: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
    fingerprint: Fingerprint | None = None,
    trust: Sequence[str | os.PathLike[str]] = (),
    report: bool = True,
    remote_cache: str = "auto",
    tier_backend: str = "auto",
    tier_timeout_s: float | None = None,
    allow_plaintext: bool | None = None,
) -> PrejobReport:
    """Run the hook; never raises for server or restore problems (see ``outcome``).

    ``remote_cache`` ("auto": the server's default, "on", "off") is whether the job uses
    the per-key tier when the server offers it; ``tier_backend`` ("auto", "cachekeeper",
    "redis") by which path (``client/tier.py``), ``tier_timeout_s`` the deadline of each
    call of cachekeeper's backend; ``allow_plaintext`` (None: ``CACHEKEEPER_ALLOW_PLAINTEXT``)
    lets the token cross plain http to a non-loopback server. A node with a trust list
    (``trust``) gets no tier: its values are not signed.

    With ``trust`` (public key files), a snapshot not signed by one of them is not restored (a cold
    start whose reason says why), and the no-op path accepts only a dir that a restore
    verified against one of them.
    """
    started = time.monotonic()
    started_at = utc_now()
    env = os.environ if environ is None else environ
    deadline = Deadline(timeout_s)
    error: CachekeeperError | None = None
    if fingerprint is None:
        left = deadline.remaining()
        try:  # inside the deadline: a hung NVML or nvidia-smi gets what is left, no more
            fingerprint = collect(
                environ=env, gpu_timeout_s=GPU_TIMEOUT_S if left is None else left
            )
        except FingerprintUnavailable as exc:
            error = exc
    target = _target(cache_dir, fingerprint, env)
    problem = None if target is None else unwritable_dir(target)
    if problem is not None:  # exporting it would crash the job: torch's default instead
        error = error or CacheDirUnusable(
            f"cannot use {target} as TORCHINDUCTOR_CACHE_DIR: {problem}; not exported,"
            " so torch uses its own default"
        )
    usable = target is not None and problem is None
    exports = {"TORCHINDUCTOR_CACHE_DIR": str(target)} if usable else {}
    result = _Outcome(error=error)
    if error is None:
        assert target is not None and fingerprint is not None
        result = _run_within(
            deadline,
            timeout_s=timeout_s,
            server=server,
            token=token,
            workload=workload,
            fingerprint=fingerprint,
            cache_dir=target,
            driver_policy=driver_policy,
            devices=devices,
            trust=tuple(trust),
            remote_cache=remote_cache,
        )
    error = result.error
    outcome = "cold" if error is not None else result.outcome
    fingerprint_digest = digest_of(fingerprint) if fingerprint is not None else ""
    usable_dir = target if usable and target is not None else None
    tier = tier_exports(
        result.offer,
        server=server or "",
        token=token,
        wish=remote_cache,
        client_name=remote_tier.client_name(node_name(), fingerprint_digest),
        timeout_s=min(PROBE_TIMEOUT_S, max(0.1, deadline.remaining() or PROBE_TIMEOUT_S)),
        backend=tier_backend,
        torch_version=None if fingerprint is None else fingerprint.get("torch"),
        trusted=bool(trust) or bool(config.trusted_key_paths(env)),
        allow_plaintext=config.allow_plaintext(env) if allow_plaintext is None else allow_plaintext,
        environment=remote_tier.environment_of(fingerprint_digest),
        stats_dir=None if usable_dir is None else tier_stats_dir(usable_dir),
        call_timeout_s=tier_timeout_s,
        environ=env,
    )
    if usable_dir is not None:  # what postjob reads: the path this job takes, or none
        prepare_tier_stats(
            usable_dir, backend=tier.backend if tier.used else None, writes=tier.writable
        )
    exports.update(tier.exports)
    reason = None if error is None else _reason(error)
    # No answer from the server (down, hung, refusing the token) says nothing against what
    # an earlier restore left: the job uses it.
    unanswered = isinstance(error, ServerUnavailable | ServerError | Unauthorized | Forbidden)
    held = held_snapshot(target) if unanswered and usable and target is not None else None
    left = deadline.remaining()
    reported = (
        report
        and fingerprint is not None  # nothing to file the report under
        and send_report(
            server,
            JobReport(
                phase="prejob",
                outcome=outcome,  # type: ignore[arg-type]  # one of JobOutcome's prejob values
                workload=workload,
                fingerprint_digest=digest_of(fingerprint),
                snapshot_id=None if error is not None else result.snapshot_id,
                node=node_name(),
                devices=list(devices or []),
                reason=None if reason is None else reason[:2000],
                reason_code=None if error is None else error.code,
                started_at=started_at,
                finished_at=utc_now(),
                job=None
                if not usable or target is None
                else job_id(target, environ=env, start=True),
            ),
            token=token,
            timeout_s=REPORT_TIMEOUT_S if left is None else min(REPORT_TIMEOUT_S, left),
        )
    )
    return PrejobReport(
        workload=workload,
        cache_dir="" if target is None else str(target),
        outcome=outcome,
        exports=exports,
        elapsed_s=time.monotonic() - started,
        snapshot_id=result.snapshot_id,
        blobs_fetched=result.blobs_fetched,
        reason=reason,
        error=error,
        reported=reported,
        deltas=result.deltas,
        delta_problems=result.delta_problems,
        remote_cache=None if result.offer is None else ("on" if tier.used else "off"),
        remote_cache_reason=tier.reason,
        remote_cache_backend=tier.backend if tier.used else None,
        remote_cache_writes=tier.used and tier.writable,
        remote_cache_note=tier.note,
        held_snapshot_id=held,
        conflicts=result.conflicts,
    )


def _target(
    cache_dir: Path | None, fingerprint: Fingerprint | None, env: Mapping[str, str]
) -> Path | None:
    """The cache dir to restore into and export; None when it depends on a fingerprint
    that could not be collected (then nothing is exported: torch's default)."""
    if cache_dir is not None:
        chosen = Path(cache_dir)
    elif fingerprint is not None:
        chosen = default_cache_dir(digest_of(fingerprint), environ=env)
    elif env.get("TORCHINDUCTOR_CACHE_DIR"):
        chosen = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    else:
        return None
    return chosen.expanduser().absolute()


def _run_within(deadline: Deadline, **work: Any) -> _Outcome:
    """``_work`` in a daemon thread, waited for until the deadline (and a moment)."""
    result = _Outcome()
    worker = threading.Thread(
        target=_work,
        name="cachekeeper-prejob",
        daemon=True,
        kwargs=dict(result=result, deadline=deadline, **work),
    )
    worker.start()
    # The calls inside honour the deadline; this guard covers what cannot (a flock held
    # by a stuck process, a hung filesystem). A restore abandoned here is still safe.
    worker.join((deadline.remaining() or 0.0) + JOIN_SLACK_S)
    if worker.is_alive():
        return _Outcome(
            error=ServerUnavailable(f"gave up waiting after the {deadline.seconds:g} s timeout")
        )
    return result


def _reason(error: CachekeeperError) -> str:
    if isinstance(error, ServerUnavailable):
        if error.detail.startswith("no server configured"):
            return error.detail
        return f"server unreachable: {error.detail}"
    if isinstance(error, Unauthorized | Forbidden):
        return f"server refused the token: {error.detail}"
    if isinstance(error, NoMatchingSnapshot):
        return error.detail
    if isinstance(error, SignatureInvalid):
        return f"refused an untrusted snapshot: {error.detail}"
    return f"{error.code}: {error.detail}"
