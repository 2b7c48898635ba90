"""The post-job hook: what did the job compile on top of the restored cache? (docs/hooks.md)

    cachekeeper postjob --workload drafter-gqa --cache-dir "$TORCHINDUCTOR_CACHE_DIR"

Run after the job (a SLURM epilog, a Kubernetes sidecar, the torchrun wrapper), torch-free
and without any change to training code. It compares the cache dir with what restores put
there (their markers, ``.cachekeeper/restored/<snapshot id>``: each lists the files it
wrote) and with what an earlier ``postjob`` already counted (``.cachekeeper/postjob.json``),
and counts the rest by kind:

- ``fxgraph``: FX-graph entries (``fxgraph/<xx>/<key>/``, one per key folder);
- ``aotautograd``: AOTAutograd entries (``aotautograd/<key>/``);
- ``triton``: Triton kernels (``triton/<device>/<hash>/``);
- ``other``: files of Inductor's code cache (``<xx>/*.py``, ``*.so``, ...), one per file.

A job whose FX-graph or AOTAutograd count is not zero ``compiled`` graphs: on top of a
restored snapshot, training called something the workload file does not list. Otherwise it
is ``clean``, whatever else appeared: a Triton kernel or an autotune result alone, after
every graph hit, is Triton or Inductor re-making a binary or a timing its cache lacked (a
kernel's compile, seconds), never a sign that the workload file is wrong; the line says
what appeared and that it is benign (``new_triton``, ``new_other`` still count it). Before
issue 31 a Triton kernel alone made a job ``compiled`` and told it that its workload file
did not match training, after 5 of 5 FX-graph hits. The outcome is reported to the server (``POST /v1/reports``) under the same
best-effort rules as the pre-job hook (``timeout_s`` bounds the fingerprint and the report
together, in wall time, whatever the server or the GPU driver does; ``push``'s upload has
its own bound, the larger of ``timeout_s`` and 30 s per request): nothing here raises for a server or a cache-dir
problem (``error`` says what), nothing is deleted, and the only file written is our own
``.cachekeeper/postjob.json`` (after a report the server stored, or with no server), so the
next job on this node counts only what it compiles itself.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachekeeper import config
from cachekeeper.errors import CachekeeperError, FingerprintUnavailable, PlaintextRefused
from cachekeeper.restore.marker import STATE_DIR, read_markers, state_dir
from cachekeeper.snapshot.scan import scan_files
from cachekeeper.wire import JobReport

from .calls import Deadline, plaintext_allowed, refuse_plaintext
from .job_reports import job_id, node_name, report_answer, utc_now
from .tier_stats import TierJob
from .tier_stats import collect as collect_tier

if TYPE_CHECKING:  # loaded in postjob(), the hook's start-up budget
    from cachekeeper.environment.fingerprint import Fingerprint

__all__ = [
    "KINDS",
    "CacheDiff",
    "PostjobReport",
    "diff_cache",
    "kind_of",
    "postjob",
    "summary_line",
]

KINDS = ("fxgraph", "aotautograd", "triton", "other")
GRAPH_KINDS = ("fxgraph", "aotautograd")  # a new one means the job compiled a graph
_ENTRY_DEPTH = {"fxgraph": 3, "aotautograd": 2, "triton": 3}  # path parts naming one entry
SEEN_FILE = "postjob.json"
REPORT_TIMEOUT_S = 5.0


def kind_of(path: str) -> str:
    """The kind of cache entry a snapshot-relative path belongs to (see the docstring)."""
    top = path.split("/", 1)[0]
    return top if top in _ENTRY_DEPTH and "/" in path else "other"


def _entry_of(path: str) -> str:
    kind = kind_of(path)
    if kind == "other":
        return path
    return "/".join(path.split("/")[: _ENTRY_DEPTH[kind]])


@dataclass(frozen=True)
class CacheDiff:
    """What a cache dir holds beyond its restores and earlier post-job counts."""

    snapshot_id: str | None  # the newest restore whose files are all still there
    restored_files: int  # paths the restore markers list
    new_files: tuple[tuple[str, int], ...]  # (path, size) of the files counted as new
    entries: dict[str, int]  # kind -> new entries
    kind_bytes: dict[str, int]  # kind -> bytes of those

    @property
    def new_bytes(self) -> int:
        return sum(self.kind_bytes.values())

    @property
    def compiled(self) -> bool:
        """The job compiled graphs (FX-graph or AOTAutograd entries appeared)."""
        return any(self.entries[k] for k in GRAPH_KINDS)

    @property
    def harvestable(self) -> bool:
        """Something ``--push`` can harvest: graphs or Triton kernels appeared."""
        return self.compiled or bool(self.entries["triton"])


def _markers(cache_dir: Path) -> list[tuple[float, str, list[list[Any]]]]:
    """(mtime, snapshot id, files) of every readable restore marker, oldest first."""
    out = []
    for mtime, body in read_markers(cache_dir):
        files = body.get("files")
        if "id" in body and isinstance(files, list):  # else not ours: it is not a baseline
            out.append((mtime, str(body["id"]), files))
    return out


def diff_cache(cache_dir: Path) -> CacheDiff:
    """Compare ``cache_dir`` with its restore markers and the last post-job count.

    Raises OSError (and LinkInCacheDir) when the dir cannot be read.
    """
    root = Path(cache_dir)
    # Sizes as the scan saw them (cachekeeper.snapshot.scan, through descriptors): nothing is
    # reached by a path again, so a file swapped for a link meanwhile is never followed.
    present = {f.rel: f.size_bytes for f in scan_files(root)}
    baseline: set[str] = set()
    snapshot_id = None
    for _mtime, marker_id, files in _markers(root):
        paths = {str(entry[0]) for entry in files}
        baseline |= paths
        if paths <= present.keys():
            snapshot_id = marker_id  # the newest complete one wins (sorted by mtime)
    restored = len(baseline)
    baseline |= _seen(root)  # what an earlier post-job counted
    new: list[tuple[str, int]] = []
    entries: dict[str, set[str]] = {k: set() for k in KINDS}
    kind_bytes = dict.fromkeys(KINDS, 0)
    for rel in sorted(present.keys() - baseline):
        size = present[rel]
        new.append((rel, size))
        kind = kind_of(rel)
        entries[kind].add(_entry_of(rel))
        kind_bytes[kind] += size
    return CacheDiff(
        snapshot_id=snapshot_id,
        restored_files=restored,
        new_files=tuple(new),
        entries={k: len(v) for k, v in entries.items()},
        kind_bytes=kind_bytes,
    )


def _seen(cache_dir: Path) -> set[str]:
    """The paths earlier post-jobs counted (none when unrecorded or unreadable)."""
    try:
        with state_dir(cache_dir, create=False) as state:
            seen = json.loads(state.read_file(SEEN_FILE) or b"")
        return {str(p) for p in seen["files"]}
    except (OSError, ValueError, KeyError, TypeError, CachekeeperError):
        return set()


def _record_seen(cache_dir: Path, diff: CacheDiff) -> None:
    """Remember what this post-job counted, so the next one counts only its own job's.

    Written through ``marker.StateDir``: a link planted in ``.cachekeeper/`` is never
    followed (a planted one is ``CacheDirUnusable``)."""
    files = _seen(cache_dir) | {p for p, _size in diff.new_files}
    body = json.dumps({"at": utc_now(), "files": sorted(files)}).encode()
    with state_dir(cache_dir, create=True) as state:
        state.write_file(SEEN_FILE, body)


@dataclass(frozen=True)
class PostjobReport:
    """What the post-job hook found and did. ``outcome``: compiled, clean or error."""

    workload: str
    cache_dir: str
    outcome: str
    elapsed_s: float
    fingerprint_digest: str
    snapshot_id: str | None = None
    entries: dict[str, int] = field(default_factory=dict)
    kind_bytes: dict[str, int] = field(default_factory=dict)
    new_files: int = 0
    autotune: int = 0  # of the ``other`` files, autotune results (``*.best_config``)
    reported: bool = False
    error: str | None = None  # why nothing could be counted; None otherwise
    warning: str | None = None  # counted, but the count could not be recorded
    pushed_snapshot_id: str | None = None  # postjob --push: the harvested delta
    pushed_offered: bool = True  # the server hands it to nodes (see summary_line)
    unknown_workload: str | None = None  # the server knows no such workload (did you mean)
    tier: TierJob | None = None  # what the job did with the per-key tier (its prejob put it on)

    @property
    def new_bytes(self) -> int:
        return sum(self.kind_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "cache_dir": self.cache_dir,
            "outcome": self.outcome,
            "elapsed_s": round(self.elapsed_s, 4),
            "fingerprint_digest": self.fingerprint_digest,
            "snapshot_id": self.snapshot_id,
            "new_entries": dict(self.entries),
            "new_bytes_by_kind": dict(self.kind_bytes),
            "new_bytes": self.new_bytes,
            "new_files": self.new_files,
            "new_autotune": self.autotune,
            "reported": self.reported,
            "error": self.error,
            "warning": self.warning,
            "pushed_snapshot_id": self.pushed_snapshot_id,
            "pushed_offered": self.pushed_offered,
            "unknown_workload": self.unknown_workload,
            "tier": None
            if self.tier is None
            else {
                "backend": self.tier.backend,
                "writes": self.tier.writes,
                "processes": self.tier.processes,
                "snapshot_hits": self.tier.snapshot_hits,
                "tier_hits": self.tier.tier_hits,
                "puts": self.tier.puts,
                "failed": self.tier.failed,
                "problem": self.tier.problem,
            },
        }


def summary_line(report: PostjobReport) -> str:
    """The one line ``cachekeeper postjob`` prints."""
    if report.error is not None:
        return f"cachekeeper: postjob: nothing counted ({report.error})"
    on = (
        f"on top of snapshot {report.snapshot_id[:12]}"
        if report.snapshot_id
        else "with no snapshot restored (a cold start)"
    )
    if report.outcome == "clean":
        if not report.new_files:
            return f"cachekeeper: postjob: the job compiled nothing new {on}"
        return f"cachekeeper: postjob: the job compiled no graph {on}; {_benign(report)}"
    e = report.entries
    what = (
        f"{e.get('fxgraph', 0)} FX graph(s), {e.get('aotautograd', 0)} AOTAutograd entr(ies),"
        f" {e.get('triton', 0)} Triton kernel(s), {e.get('other', 0)} other file(s)"
        f" ({report.new_bytes / 1e6:.1f} MB)"
    )
    line = f"cachekeeper: postjob: the job compiled {what} {on}"
    if report.pushed_snapshot_id:
        line += f"; harvested as snapshot {report.pushed_snapshot_id[:12]}"
        if not report.pushed_offered:
            line += (
                " (kept back: this server does not offer harvested snapshots to nodes"
                " unless it runs with --serve-harvested; an agent never signs harvested"
                " bytes: it rebuilds a workload with a [[command]] itself and publishes the"
                " entries its own run compiles; add the job's shapes to the workload)"
            )
    if report.snapshot_id:
        line += (
            "; the workload file does not match training: run `cachekeeper explain` and see"
            " docs/workloads.md"
        )
    return line


def _benign(report: PostjobReport) -> str:
    """What appeared in a job that compiled no graph, and why it does not matter."""
    e = report.entries
    parts = []
    if e.get("triton"):
        parts.append(f"{e['triton']} Triton kernel(s)")
    if report.autotune:
        parts.append(f"{report.autotune} autotune result(s)")
    code = e.get("other", 0) - report.autotune
    if code:
        parts.append(f"{code} other file(s) of Inductor's code cache")
    what = ", ".join(parts) + f" ({report.new_bytes / 1e6:.1f} MB)"
    after = "every FX graph and AOTAutograd entry it used hit" if report.snapshot_id else ""
    return (
        f"new: {what}, made again at run time"
        + (f" ({after})" if after else "")
        + ": benign, no sign that the workload file differs from training; nothing to do"
    )


def _autotune_files(diff: CacheDiff) -> int:
    return sum(1 for path, _size in diff.new_files if path.endswith(".best_config"))


def postjob(
    *,
    workload: str,
    server: str | None,
    token: str | None = None,
    cache_dir: Path | None = None,
    devices: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
    fingerprint: Fingerprint | None = None,
    report: bool = True,
    timeout_s: float = REPORT_TIMEOUT_S,
    push: bool = False,
    sign_key: str | os.PathLike[str] | None = None,
) -> PostjobReport:
    """Count what the job compiled on top of the restore and report it; never raises for a
    server or cache-dir problem (see ``error``).

    With ``push`` (a write-scope token), what the job compiled is also uploaded as a
    harvested delta of the same workload and fingerprint, parented on the restored snapshot
    (``pushed_snapshot_id``; a failure is a ``warning``). Nothing is pushed after a cold
    start (no parent) or when nothing new was compiled.
    """
    from cachekeeper.environment.fingerprint import collect, digest_of  # the hook's start-up budget

    started = time.monotonic()
    started_at = utc_now()
    deadline = Deadline(timeout_s)  # the fingerprint and the report share it
    env = os.environ if environ is None else environ
    if fingerprint is None:
        try:  # a hung NVML or nvidia-smi gets the deadline, no more
            fingerprint = collect(environ=env, gpu_timeout_s=deadline.remaining() or 0.0)
        except FingerprintUnavailable as exc:
            return PostjobReport(
                workload=workload,
                cache_dir="" if cache_dir is None else str(cache_dir),
                outcome="error",
                elapsed_s=time.monotonic() - started,
                fingerprint_digest="",
                error=f"cannot fingerprint this node: {exc.detail}",
            )
    digest = digest_of(fingerprint)
    if cache_dir is None:
        explicit = env.get("TORCHINDUCTOR_CACHE_DIR")
        cache_dir = Path(explicit) if explicit else config.node_cache_dir(digest, env)
    target = Path(cache_dir).expanduser().absolute()
    try:
        diff = diff_cache(target)
    except (OSError, CachekeeperError) as exc:
        detail = exc.detail if isinstance(exc, CachekeeperError) else str(exc)
        return PostjobReport(
            workload=workload,
            cache_dir=str(target),
            outcome="error",
            elapsed_s=time.monotonic() - started,
            fingerprint_digest=digest,
            error=f"cannot read {target}: {detail}",
        )
    outcome = "compiled" if diff.compiled else "clean"
    refused = _plaintext_refused(server, token=token, environ=env) if report else None
    tier = collect_tier(target)
    answer = (
        report
        and refused is None
        and report_answer(
            server,
            JobReport(
                phase="postjob",
                outcome=outcome,  # type: ignore[arg-type]  # one of JobOutcome's postjob values
                workload=workload,
                fingerprint_digest=digest,
                snapshot_id=diff.snapshot_id,
                node=node_name(),
                devices=list(devices or []),
                new_fxgraph=diff.entries["fxgraph"],
                new_aotautograd=diff.entries["aotautograd"],
                new_triton=diff.entries["triton"],
                new_other=diff.entries["other"],
                new_bytes=diff.new_bytes,
                started_at=started_at,
                finished_at=utc_now(),
                job=job_id(target, environ=env, start=False),
                tier=None if tier is None else tier.backend,  # type: ignore[arg-type]  # a TierPath
                snapshot_hits=0 if tier is None else tier.snapshot_hits,
                tier_hits=0 if tier is None else tier.tier_hits,
                tier_puts=0 if tier is None else tier.puts,
                tier_failed=0 if tier is None else tier.failed,
                tier_problem=None if tier is None or tier.problem is None else tier.problem[:2000],
            ),
            token=token,
            timeout_s=deadline.remaining() or 0.0,
        )
    )
    reported = bool(answer)
    warning = None if refused is None else f"not reported: {refused}"
    pushed = None
    offered = True
    if push:
        pushed, offered, warning = _harvest(
            target,
            diff,
            workload=workload,
            server=server,
            token=token,
            fingerprint=fingerprint,
            sign_key=sign_key,
            timeout_s=timeout_s,
        )
    if reported or not (report and server):
        try:
            _record_seen(target, diff)
        except (OSError, CachekeeperError) as exc:  # a read-only cache dir: the count stands
            detail = exc.detail if isinstance(exc, CachekeeperError) else str(exc)
            warning = f"cannot record the count in {target / STATE_DIR}: {detail}"
    return PostjobReport(
        workload=workload,
        cache_dir=str(target),
        outcome=outcome,
        elapsed_s=time.monotonic() - started,
        fingerprint_digest=digest,
        snapshot_id=diff.snapshot_id,
        entries=dict(diff.entries),
        kind_bytes=dict(diff.kind_bytes),
        new_files=len(diff.new_files),
        autotune=_autotune_files(diff),
        reported=reported,
        warning=warning,
        pushed_snapshot_id=pushed,
        pushed_offered=offered,
        unknown_workload=answer.warning if answer else None,
        tier=tier,
    )


def _plaintext_refused(
    server: str | None, *, token: str | None, environ: Mapping[str, str]
) -> str | None:
    """Why the report may not be sent (the token would go in clear text), else None."""
    try:
        refuse_plaintext(server or "", token=token, allow=plaintext_allowed(environ))
    except PlaintextRefused as exc:
        return exc.detail
    return None


def _harvest(
    cache_dir: Path,
    diff: CacheDiff,
    *,
    workload: str,
    server: str | None,
    token: str | None,
    fingerprint: Fingerprint,
    sign_key: str | os.PathLike[str] | None,
    timeout_s: float,
) -> tuple[str | None, bool, str | None]:
    """Push the job's new files as a harvested delta: (its id, whether the server offers it
    to nodes, None), or (None, True, why not)."""
    if not diff.harvestable:
        return None, True, None
    if diff.snapshot_id is None:
        return None, True, "nothing harvested: no snapshot was restored here to layer it on"
    if not server:
        return None, True, "nothing harvested: no server (--server or CACHEKEEPER_SERVER)"
    from .api import CacheClient  # only with --push: httpx and the snapshot stack
    from .push import push as push_snapshot

    try:
        with CacheClient(base_url=server, token=token, timeout_s=max(timeout_s, 30.0)) as client:
            done = push_snapshot(
                cache_dir,
                client=client,
                workload=workload,
                fingerprint=fingerprint,
                sign_key=sign_key,
                only=[path for path, _size in diff.new_files],
                parent=diff.snapshot_id,
            )
    except (CachekeeperError, OSError) as exc:
        detail = exc.detail if isinstance(exc, CachekeeperError) else str(exc)
        return None, True, f"harvest not pushed: {detail}"
    return done.snapshot_id, done.offered, None
