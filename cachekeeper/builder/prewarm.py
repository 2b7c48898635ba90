"""Prewarm: cold-compile a workload in fresh processes, merge, verify.

``prewarm(workload, cache_dir, devices=[...])``:

1. For each device, one fresh child process (``python -m cachekeeper.builder._child``) with an
   empty staging ``TORCHINDUCTOR_CACHE_DIR`` runs the tables of the device kinds in order
   (every regime, then every entrypoint: ``cachekeeper.builder.kinds``). GPUs run in
   parallel, one process each, on their real index (all GPUs stay visible: the device
   index is part of Inductor's key). The CPU is one process.
2. Then each table of a process kind (each ``[[command]]``), in order, runs once with its
   own empty staging dir (``cachekeeper.builder.commands``): the site's launcher picks its
   own devices and ranks, and every Python process it starts reports its counters.
3. If any child's workload raised, or a command exited non-zero, the cold compile is
   broken: the report says ``cold_compile_broken`` with the exception (or the command's
   last output lines), and nothing is merged; a command that exited non-zero having
   compiled nothing is ``command_failed`` instead (``cachekeeper.builder.commands``). Any
   other failure (crash, timeout, an import path that does not resolve, a command that
   cannot start) is ``failed``; nothing is merged either.
4. Otherwise every staging dir is merged into ``cache_dir`` with the restore rules
   (``cachekeeper.restore.merge_tree``: never delete, verified, atomic).
5. Then ``cachekeeper.builder.verify.verify``: a fresh child per device against
   ``cache_dir``, and each command again in a fresh copy of ``cache_dir`` (as a node
   restores it), judged by ``cachekeeper.builder.verdicts.is_effective`` per device and per
   process.

The children and their work area: ``cachekeeper.builder.children``.
"""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path
from typing import Any, cast

from cachekeeper import remote_tier
from cachekeeper.builder.children import child_cpu_state, run_children, slug, work_area
from cachekeeper.builder.confine import Confinement
from cachekeeper.builder.kinds import ProcessKind
from cachekeeper.builder.verdicts import CommandRun, DeviceRun, ErrorInfo, PrewarmReport, Progress
from cachekeeper.builder.verify import verify
from cachekeeper.builder.workload import Workload
from cachekeeper.environment.fingerprint import CpuState
from cachekeeper.errors import CacheDirUnusable, CachekeeperError
from cachekeeper.restore import merge_tree
from cachekeeper.restore.marker import unusable_reason
from cachekeeper.snapshot.provenance import record_prewarm

__all__ = ["prewarm", "compiled_cpu_state"]


def prewarm(
    workload: Workload,
    cache_dir: Path,
    *,
    devices: list[str],
    progress: Progress | None = None,
    timeout_s: float | None = None,
    confinement: Confinement | None = None,
) -> PrewarmReport:
    """Cold-compile ``workload`` (per device, then each command), merge into ``cache_dir``,
    then verify.

    Never raises for what the workload does (see ``PrewarmReport.status``); raises
    CacheDirUnusable, before anything is compiled, when ``cache_dir`` cannot be filled
    (``marker.unusable_reason``: a file created, written and renamed in it and in its
    ``.cachekeeper/``), and PrewarmFailed when the work area cannot be created.
    ``timeout_s`` bounds each child and each command run. ``devices`` are where the device
    kinds' tables (``[[attention]]``, ``[[entrypoint]]``) run; a command's ranks choose
    their own. ``confinement`` is what every process of the build is held to
    (``cachekeeper.builder.confine``; the agent hides its signing key).
    """
    cache_dir = Path(cache_dir).absolute()
    # Before minutes of compiling: a dir the merge could not fill fails now, naming it.
    problem = unusable_reason(cache_dir)
    if problem is not None:
        raise CacheDirUnusable(f"cannot prewarm into {cache_dir}: {problem}; nothing was compiled")
    started = time.monotonic()
    child_devices = list(devices) if workload.device_tables else []

    def report(**fields: Any) -> PrewarmReport:
        return PrewarmReport(
            workload=workload.name,
            workload_digest=workload.digest,
            cache_dir=str(cache_dir),
            seconds=round(time.monotonic() - started, 3),
            **fields,
        )

    with work_area(cache_dir) as work:
        staging = {device: work / f"staging-{slug(device)}" for device in child_devices}
        for path in staging.values():
            path.mkdir()
        runs: list[DeviceRun] = []
        if child_devices:
            runs = run_children(
                workload,
                staging,
                mode="prewarm",
                work=work,
                progress=progress,
                timeout_s=timeout_s,
                confinement=confinement,
            )
        cold: list[CommandRun] = []
        if all(run.status == "ok" for run in runs):
            for table in workload.process_tables:
                path = staging[table.name] = work / f"staging-{table.kind.table}_{table.index}"
                path.mkdir()
                cold.append(
                    cast(ProcessKind, table.kind).run(
                        table.spec,
                        index=table.index,
                        mode="prewarm",
                        cache_dir=path,
                        work=work,
                        progress=progress,
                        timeout_s=timeout_s,
                        confinement=confinement,
                    )
                )
                if cold[-1].status != "ok":
                    break
        if any(run.status != "ok" for run in runs) or any(run.status != "ok" for run in cold):
            return report(devices=tuple(runs), commands=tuple(cold))
        merged: dict[str, dict[str, Any]] = {}
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            for name, path in staging.items():
                merged[name] = merge_tree(path, cache_dir).to_dict()
                merged[name].pop("planned", None)
        except CachekeeperError as exc:
            return report(
                devices=tuple(runs),
                commands=tuple(cold),
                merged=merged,
                error=ErrorInfo(type=type(exc).__name__, message=exc.detail, where="merge"),
            )
    verify_report = verify(
        workload,
        cache_dir,
        devices=child_devices,
        timeout_s=timeout_s,
        progress=progress,
        confinement=confinement,
    )
    done = report(devices=tuple(runs), commands=tuple(cold), merged=merged, verify=verify_report)
    _record(workload, cache_dir, done, commands=tuple(cold))
    return done


def _record(
    workload: Workload, cache_dir: Path, report: PrewarmReport, *, commands: tuple[CommandRun, ...]
) -> None:
    """What ``report`` proved, kept in ``cache_dir`` for the snapshot (provenance)."""
    record_prewarm(
        cache_dir,
        workload=workload.name,
        workload_digest=workload.digest,
        devices=list(report.covered_devices),
        stats=report.stats,
        cpu=compiled_cpu_state(workload, commands),
        key_switches=remote_tier.key_switches(os.environ),  # what the children ran with
    )


def compiled_cpu_state(workload: Workload, commands: tuple[CommandRun, ...]) -> CpuState:
    """The CPU state the caches were compiled under (the fingerprint's ``cpu`` field).

    The children's (the workload's ``[process]``), unless commands compiled: then the
    thread count their compiling processes had (torchrun gives each rank one thread when
    it starts several), the most common one if they differ.
    """
    state = child_cpu_state(workload.omp_num_threads)
    threads = collections.Counter(
        proc.threads for run in commands for proc in run.compiling if proc.threads
    )
    if not threads:
        return state
    count, _ = threads.most_common(1)[0]
    return {**state, "threads": count, "threads_from": "the command's processes"}
