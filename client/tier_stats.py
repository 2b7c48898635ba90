"""What a job did with the per-key tier, from the counts its processes left (stdlib only).

``prejob`` names ``<cache dir>/.cachekeeper/tier-stats/`` in ``CACHEKEEPER_TIER_STATS_DIR``
and writes ``prejob.json`` there (which path the job takes to the tier, whether it writes).
Every Python process of the job that imported torch's remote caches writes
``tier-<pid>.json`` at exit (``cachekeeper/_tier_hook/_cachekeeper_tier.py``). ``postjob``
adds them up (``collect``) and removes what it read, so the next job counts only its own:

- entries from the snapshots: FX graph and AOTAutograd hits that were not the tier's
  (torch's counters less its remote caches' hits): the restored dir, or what earlier
  jobs on this node compiled into it;
- entries from the tier: the remote FX graph and AOTAutograd caches' hits;
- puts into the tier (stored by the server), and calls that failed (the circuit breaker);
- a problem, when the tier was on but the job asked it nothing, with its likely cause:
  no process loaded the hook (a launcher or container that resets the environment), the
  job's Python has no redis-py (the stock path), a torch whose remote cache module
  differs, or a tier that failed.

Everything here reads through ``marker.StateDir``: a link planted in ``.cachekeeper/`` is
never followed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachekeeper.errors import CacheDirUnusable
from cachekeeper.restore.marker import STATE_DIR, state_dir
from cachekeeper.wire import utc_now

__all__ = ["FOLDER", "TierJob", "collect", "prepare", "stats_dir"]

FOLDER = "tier-stats"
PREJOB_FILE = f"{FOLDER}/prejob.json"
_FX, _AOT = "RemoteFxGraphCache", "RemoteAOTAutogradCache"
MAX_FILES = 4096  # processes counted per job (a bound on what postjob reads)


def stats_dir(cache_dir: Path) -> Path:
    """Where a job's processes leave their tier counts."""
    return Path(cache_dir) / STATE_DIR / FOLDER


def prepare(cache_dir: Path, *, backend: str | None, writes: bool) -> Path | None:
    """Record this job's tier path (None: the job does not use the tier) in the cache dir;
    the folder to export, or None (no tier, or a dir that cannot hold it)."""
    try:
        with state_dir(Path(cache_dir), create=backend is not None) as state:
            if backend is None:
                state.remove_file(PREJOB_FILE)
                return None
            state.folder(FOLDER)
            body = {"backend": backend, "writes": writes, "at": utc_now()}
            state.write_file(PREJOB_FILE, json.dumps(body).encode())
    except (OSError, CacheDirUnusable):
        return None
    return stats_dir(cache_dir)


@dataclass(frozen=True)
class TierJob:
    """What one job did with the tier (see the module docstring)."""

    backend: str  # "cachekeeper" or "redis"
    writes: bool
    processes: int  # processes that left counts
    snapshot_hits: int
    tier_hits: int
    puts: int
    failed: int
    problem: str | None = None
    reasons: tuple[str, ...] = field(default=())  # why the hook did not install, one each

    @property
    def requests(self) -> int:
        return self.tier_hits + self.puts + self.failed

    def line(self) -> str:
        """postjob's line about the tier."""
        text = (
            f"per-key tier ({self.backend}): {self.snapshot_hits} entr(ies) from the snapshots,"
            f" {self.tier_hits} from the tier, {self.puts} put into it, {self.failed} failed"
        )
        return text + (f"; PROBLEM: {self.problem}" if self.problem else "")


def _remote(stats: dict[str, Any], name: str, what: str) -> int:
    try:
        return int(stats.get("remote", {}).get(name, {}).get(what, 0))
    except (TypeError, ValueError, AttributeError):
        return 0


def _count(stats: dict[str, Any], group: str, what: str) -> int:
    try:
        return int(stats.get(group, {}).get(what, 0))
    except (TypeError, ValueError, AttributeError):
        return 0


def collect(cache_dir: Path) -> TierJob | None:
    """The job's tier counts (None when its prejob did not put it on the tier); what was
    read is removed."""
    try:
        with state_dir(Path(cache_dir), create=False) as state:
            prejob = json.loads(state.read_file(PREJOB_FILE) or b"null")
            if not isinstance(prejob, dict):
                return None
            procs: list[dict[str, Any]] = []
            for name in sorted(state.names(FOLDER))[:MAX_FILES]:
                if not (name.startswith("tier-") and name.endswith(".json")):
                    continue
                raw = state.read_file(f"{FOLDER}/{name}")
                try:
                    found = json.loads(raw or b"")
                except ValueError:
                    found = None
                if isinstance(found, dict):
                    procs.append(found)
                state.remove_file(f"{FOLDER}/{name}")
            state.remove_file(PREJOB_FILE)
    except (OSError, CacheDirUnusable, ValueError):
        return None
    return _judge(str(prejob.get("backend")), bool(prejob.get("writes")), procs)


def _judge(backend: str, writes: bool, procs: list[dict[str, Any]]) -> TierJob:
    hits = tier_hits = puts = failed = 0
    reasons: list[str] = []
    breakers: list[str] = []
    no_redis = 0
    for p in procs:
        counters = p.get("counters") or {}
        try:
            hits += int(counters.get("fxgraph_cache_hit", 0)) + int(
                counters.get("autograd_cache_hit", 0)
            )
        except (TypeError, ValueError, AttributeError):
            pass
        tier_hits += _remote(p, _FX, "hit") + _remote(p, _AOT, "hit")
        if backend == "cachekeeper":
            puts += _count(p, "puts", "stored")
            failed += _count(p, "gets", "failed") + _count(p, "puts", "failed")
        else:
            puts += _remote(p, _FX, "put") + _remote(p, _AOT, "put")
            failed += _remote(p, _FX, "exception") + _remote(p, _AOT, "exception")
        if backend == "cachekeeper" and not p.get("installed") and p.get("reason"):
            reasons.append(str(p["reason"])[:300])
        if p.get("breaker"):
            breakers.append(str(p["breaker"])[:300])
        if p.get("redis_importable") is False:
            no_redis += 1
    requests = (
        tier_hits
        + puts
        + failed
        + sum(
            _count(p, "gets", "miss") + _remote(p, _FX, "miss") + _remote(p, _AOT, "miss")
            for p in procs
        )
    )
    problem = None
    if not procs:
        problem = (
            "the tier was on but no process of the job loaded cachekeeper's hook: the job's"
            " Python processes did not inherit prejob's exports (a launcher or container that"
            " resets the environment, e.g. PYTHONPATH), or none of them compiled"
        )
    elif requests == 0:
        if reasons:
            problem = f"the tier was on but asked nothing: {reasons[0]}"
        elif no_redis:
            problem = (
                "the tier was on but asked nothing: the job's Python has no redis-py, so"
                " torch turned its remote caches off (pip install redis, or prejob"
                " --tier-backend cachekeeper)"
            )
        else:
            problem = (
                "the tier was on but torch asked it nothing: the TORCHINDUCTOR_*_REMOTE_CACHE"
                " switches were reset, or nothing reached Inductor"
            )
    elif breakers:
        problem = f"the tier failed and was left for the rest of the process: {breakers[0]}"
    return TierJob(
        backend=backend,
        writes=writes,
        processes=len(procs),
        snapshot_hits=max(0, hits - tier_hits),
        tier_hits=tier_hits,
        puts=puts,
        failed=failed,
        problem=problem,
        reasons=tuple(reasons),
    )
