"""Verify: prove a cache dir is effective for a workload, in fresh processes.

The tables of the device kinds (``[[attention]]``, ``[[entrypoint]]``) run in a fresh
child per device against the cache dir itself (``cachekeeper.builder.children``). Each
table of a process kind (``[[command]]``) runs in a fresh *copy* of the cache dir, made
with the restore rules (``merge_tree``: verified, ``.cachekeeper/`` left out) in a work
area next to it: so the run sees the cache as a node restores it, at another path, and
whatever a missing run compiles never lands in the cache dir. The
verdict on each device's and each compiling process's counters is
``cachekeeper.builder.verdicts.is_effective``.

The verdict is also judged from outside the processes under test
(``cachekeeper.builder.cache_watch``): the device runs' cache dir, and each command's copy,
must gain no FX graph or AOTAutograd entry while they run, and at least one entry of a
command's copy must be read; a command's processes must all be accounted for (a start record
with no end is a gap).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import cast

from cachekeeper.builder.cache_watch import Watch
from cachekeeper.builder.children import run_children, work_area
from cachekeeper.builder.confine import Confinement
from cachekeeper.builder.kinds import ProcessKind
from cachekeeper.builder.verdicts import CommandRun, DeviceRun, Progress, VerifyReport
from cachekeeper.builder.workload import Workload
from cachekeeper.errors import PrewarmFailed
from cachekeeper.restore import merge_tree
from cachekeeper.snapshot.provenance import load_prewarm_record

__all__ = ["verify", "built_devices"]


def verify(
    workload: Workload,
    cache_dir: Path,
    *,
    devices: list[str],
    timeout_s: float | None = None,
    progress: Progress | None = None,
    confinement: Confinement | None = None,
) -> VerifyReport:
    """Run ``workload`` against ``cache_dir`` in fresh processes; judge the counters.

    ``devices`` are where the device kinds' tables (``[[attention]]``, ``[[entrypoint]]``)
    run (ignored when the workload has none); commands choose their own. What a device run
    that misses compiles is written into ``cache_dir`` by Inductor itself (it only adds
    entries); a command's run writes into its copy only. ``confinement`` is what every
    process of the verify is held to (``cachekeeper.builder.confine``).
    """
    cache_dir = Path(cache_dir).absolute()
    if not cache_dir.is_dir():
        raise PrewarmFailed(f"cache dir {cache_dir} does not exist or is not a directory")
    started = time.monotonic()
    runs: list[DeviceRun] = []
    commands: list[CommandRun] = []
    watched = None
    with work_area(cache_dir) as work:
        if workload.device_tables:
            watch = Watch.start(cache_dir, mark_reads=False)  # the user's dir: gains only
            runs = run_children(
                workload,
                {device: cache_dir for device in devices},
                mode="verify",
                work=work,
                progress=progress,
                timeout_s=timeout_s,
                confinement=confinement,
            )
            watched = watch.finish()
        for table in workload.process_tables:
            fresh = work / f"restored-{table.kind.table}_{table.index}"
            merge_tree(cache_dir, fresh)
            copy_watch = Watch.start(fresh, mark_reads=True)  # our own copy: reads too
            run = cast(ProcessKind, table.kind).run(
                table.spec,
                index=table.index,
                mode="verify",
                cache_dir=fresh,
                work=work,
                progress=progress,
                timeout_s=timeout_s,
                confinement=confinement,
            )
            commands.append(replace(run, watch=copy_watch.finish()))
    return VerifyReport(
        workload=workload.name,
        workload_digest=workload.digest,
        cache_dir=str(cache_dir),
        devices=tuple(runs),
        seconds=round(time.monotonic() - started, 3),
        built_devices=built_devices(cache_dir, workload),
        commands=tuple(commands),
        watch=watched,
    )


def built_devices(cache_dir: Path, workload: Workload) -> tuple[str, ...]:
    """The devices ``cache_dir`` was built on, as far as it shows: the record a prewarm of
    this workload text left (``cachekeeper.snapshot.provenance``), else its ``triton/<index>``
    folders (Triton keeps one per GPU index); ``()`` when neither says."""
    record = load_prewarm_record(cache_dir, workload.name)
    if record is not None and record.get("workload_digest") == workload.digest:
        return tuple(str(d) for d in record.get("devices") or ())
    try:
        found = sorted(int(p.name) for p in (cache_dir / "triton").iterdir() if p.name.isdigit())
    except OSError:
        return ()
    return tuple(f"cuda:{i}" for i in found)
