"""Prewarm: cold-compile a workload per device in fresh processes, merge, verify.

``prewarm(workload, cache_dir, devices=[...])``:

1. For each device, one fresh child process (``python -m cachekeeper._child``) with an
   empty staging ``TORCHINDUCTOR_CACHE_DIR`` compiles every regime in order, then every
   entrypoint. GPUs run in parallel, one process each, on their real index (all GPUs stay
   visible: the device index is part of Inductor's key). The CPU is one process.
2. If any child's workload raised, the cold compile is broken: the report says
   ``cold_compile_broken`` with the exception and its last traceback lines, and nothing
   is merged. Any other child failure (crash, timeout, an import path that does not
   resolve) is ``failed``; nothing is merged either.
3. Otherwise every staging dir is merged into ``cache_dir`` with the restore rules
   (``cachekeeper.restore.merge_tree``: never delete, verified, atomic).
4. Then ``cachekeeper.verify.verify``: a fresh child per device against ``cache_dir``,
   judged by ``cachekeeper.reports.is_effective``.

The children and their work area: ``cachekeeper.children``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cachekeeper.children import child_cpu_state, run_children, slug, work_area
from cachekeeper.errors import CachekeeperError
from cachekeeper.provenance import record_prewarm
from cachekeeper.reports import ErrorInfo, PrewarmReport, Progress
from cachekeeper.restore import merge_tree
from cachekeeper.verify import verify
from cachekeeper.workload import Workload

__all__ = ["prewarm"]


def prewarm(
    workload: Workload,
    cache_dir: Path,
    *,
    devices: list[str],
    progress: Progress | None = None,
    timeout_s: float | None = None,
) -> PrewarmReport:
    """Cold-compile ``workload`` on each device, merge into ``cache_dir``, then verify.

    Never raises for what the workload does (see ``PrewarmReport.status``); raises
    PrewarmFailed when the work area cannot be created. ``timeout_s`` bounds each child.
    """
    cache_dir = Path(cache_dir).absolute()
    started = time.monotonic()
    with work_area(cache_dir) as work:
        staging = {device: work / f"staging-{slug(device)}" for device in devices}
        for path in staging.values():
            path.mkdir()
        runs = run_children(
            workload,
            {d: staging[d] for d in devices},
            mode="prewarm",
            work=work,
            progress=progress,
            timeout_s=timeout_s,
        )
        if any(run.status != "ok" for run in runs):
            return PrewarmReport(
                workload=workload.name,
                workload_digest=workload.digest,
                cache_dir=str(cache_dir),
                devices=tuple(runs),
                seconds=round(time.monotonic() - started, 3),
            )
        merged: dict[str, dict[str, Any]] = {}
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            for device in devices:
                merged[device] = merge_tree(staging[device], cache_dir).to_dict()
                merged[device].pop("planned", None)
        except CachekeeperError as exc:
            return PrewarmReport(
                workload=workload.name,
                workload_digest=workload.digest,
                cache_dir=str(cache_dir),
                devices=tuple(runs),
                seconds=round(time.monotonic() - started, 3),
                merged=merged,
                error=ErrorInfo(type=type(exc).__name__, message=exc.detail, where="merge"),
            )
    verify_report = verify(
        workload, cache_dir, devices=devices, timeout_s=timeout_s, progress=progress
    )
    report = PrewarmReport(
        workload=workload.name,
        workload_digest=workload.digest,
        cache_dir=str(cache_dir),
        devices=tuple(runs),
        seconds=round(time.monotonic() - started, 3),
        merged=merged,
        verify=verify_report,
    )

    record_prewarm(
        cache_dir,
        workload=workload.name,
        workload_digest=workload.digest,
        devices=list(devices),
        stats=report.stats,
        cpu=child_cpu_state(workload.omp_num_threads),
    )
    return report
