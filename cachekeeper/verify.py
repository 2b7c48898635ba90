"""Verify: prove a cache dir is effective for a workload, in a fresh process per device.

The verdict on each run's counters is ``cachekeeper.reports.is_effective``; the children
run through ``cachekeeper.children``.
"""

from __future__ import annotations

import time
from pathlib import Path

from cachekeeper.children import run_children, work_area
from cachekeeper.errors import PrewarmFailed
from cachekeeper.provenance import load_prewarm_record
from cachekeeper.reports import Progress, VerifyReport
from cachekeeper.workload import Workload

__all__ = ["verify", "built_devices"]


def verify(
    workload: Workload,
    cache_dir: Path,
    *,
    devices: list[str],
    timeout_s: float | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Run ``workload`` against ``cache_dir`` in a fresh process per device; judge counters.

    What a run that misses compiles is written into ``cache_dir`` by Inductor itself (it
    only adds entries); the verdict comes from the counters of this run.
    """
    cache_dir = Path(cache_dir).absolute()
    if not cache_dir.is_dir():
        raise PrewarmFailed(f"cache dir {cache_dir} does not exist or is not a directory")
    started = time.monotonic()
    with work_area(cache_dir) as work:
        runs = run_children(
            workload,
            {device: cache_dir for device in devices},
            mode="verify",
            work=work,
            progress=progress,
            timeout_s=timeout_s,
        )
    return VerifyReport(
        workload=workload.name,
        workload_digest=workload.digest,
        cache_dir=str(cache_dir),
        devices=tuple(runs),
        seconds=round(time.monotonic() - started, 3),
        built_devices=built_devices(cache_dir, workload),
    )


def built_devices(cache_dir: Path, workload: Workload) -> tuple[str, ...]:
    """The devices ``cache_dir`` was built on, as far as it shows: the record a prewarm of
    this workload text left (``cachekeeper.provenance``), else its ``triton/<index>``
    folders (Triton keeps one per GPU index); ``()`` when neither says."""
    record = load_prewarm_record(cache_dir, workload.name)
    if record is not None and record.get("workload_digest") == workload.digest:
        return tuple(str(d) for d in record.get("devices") or ())
    try:
        found = sorted(int(p.name) for p in (cache_dir / "triton").iterdir() if p.name.isdigit())
    except OSError:
        return ()
    return tuple(f"cuda:{i}" for i in found)
