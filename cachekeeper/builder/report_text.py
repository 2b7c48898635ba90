"""Prewarm and verify reports as text for people (``cachekeeper prewarm`` / ``verify``).

The verdicts themselves are ``cachekeeper.builder.verdicts``; this module only words them.
"""

from __future__ import annotations

from cachekeeper.builder.verdicts import CommandRun, DeviceRun, PrewarmReport, VerifyReport

__all__ = ["format_prewarm", "format_verify"]


def _counts(counters: dict[str, int]) -> str:
    short = {
        "fxgraph_cache_hit": "fx hit",
        "fxgraph_cache_miss": "fx miss",
        "fxgraph_cache_bypass": "fx bypass",
        "autograd_cache_hit": "aot hit",
        "autograd_cache_miss": "aot miss",
        "autograd_cache_bypass": "aot bypass",
    }
    parts = [f"{label} {counters[key]}" for key, label in short.items() if counters.get(key)]
    return ", ".join(parts) or "no cache activity"


def _error_lines(run: DeviceRun) -> list[str]:
    if run.error is None:
        return []
    err = run.error
    lines = [f"    {err.type}: {err.message}" + (f"  (in {err.where})" if err.where else "")]
    lines += [f"      {line}" for line in err.traceback_tail]
    return lines


def _run_lines(run: DeviceRun) -> list[str]:
    head = (
        f"  {run.device}  {run.mode} {run.status}  {run.seconds:.1f} s  [{_counts(run.counters)}]"
    )
    if run.mode == "verify":
        head += "  effective" if run.effective else "  NOT effective"
    lines = [head]
    for r in run.regimes:
        seqs = " + ".join(f"{s:.1f}" for s in r.seq_seconds) or f"{r.seconds:.1f}"
        lines.append(f"    {r.name:<14} {r.label}")
        lines.append(f"    {'':<14} {seqs} s  [{_counts(r.counters)}]  {r.verdict}")
    return lines + _error_lines(run)


def _command_lines(run: CommandRun) -> list[str]:
    head = f"  {run.name}  {run.mode} {run.status}  {run.seconds:.1f} s"
    if run.exit_code is not None:
        head += f"  exit {run.exit_code}"
    if run.mode == "verify":
        head += "  effective" if run.effective else "  NOT effective"
    lines = [head, f"    $ {run.command}"]
    shown = [p for p in run.processes if p.compiled or p.exit_status == "exception"]
    for proc in shown:
        verdict = ""
        if run.mode == "verify" and proc.compiled:
            verdict = "  hit" if proc.effective else "  MISS"
        lines.append(f"    {proc.label:<32} [{_counts(proc.counters)}]{verdict}")
        if proc.exit_status == "exception":
            lines.append(f"      raised {proc.error}")
        elif proc.exit_code:
            lines.append(f"      exited with status {proc.exit_code}")
    others = len(run.processes) - len(shown)
    if others:
        lines.append(f"    ({others} other Python process(es) compiled nothing)")
    if run.watch is not None:
        read = "not measured" if run.watch.read is None else str(run.watch.read)
        lines.append(
            f"    seen from outside: {run.watch.entries} entries, {run.watch.gained_count}"
            f" gained or changed, {read} read"
        )
    if run.left_running:
        lines.append(f"    stopped what it left running: {'; '.join(run.left_running[:3])}")
    if run.error is not None:
        lines.append(f"    {run.error.type}: {run.error.message}")
    if run.status != "ok" and run.status != "invalid" and run.log_tail:
        lines.append("    the command's last output lines:")
        lines += [f"      {line}" for line in run.log_tail]
    return lines


def _report_lines(
    head: str, devices: tuple[DeviceRun, ...], commands: tuple[CommandRun, ...]
) -> list[str]:
    lines = [head]
    for run in devices:
        lines += _run_lines(run)
    for command in commands:
        lines += _command_lines(command)
    return lines


def format_verify(report: VerifyReport) -> str:
    head = (
        f"verify {report.workload} against {report.cache_dir}: {report.status} "
        f"({report.seconds:.1f} s)"
    )
    lines = _report_lines(head, report.devices, report.commands)
    lines += [f"  NOT effective: {reason}" for reason in report.reasons]
    return "\n".join(lines)


def format_prewarm(report: PrewarmReport) -> str:
    head = (
        f"prewarm {report.workload} into {report.cache_dir}: {report.status} "
        f"({report.seconds:.1f} s)"
    )
    lines = _report_lines(head, report.devices, report.commands)
    for device, merged in report.merged.items():
        lines.append(
            f"  merged {device}: {merged.get('written', 0)} files written, "
            f"{merged.get('skipped', 0)} already present, "
            f"{len(merged.get('conflicts', ()))} conflicts kept"
        )
    if report.error is not None:
        lines.append(f"  {report.error.type}: {report.error.message}")
    if report.status == "cold_compile_broken":
        lines.append("  nothing was merged into the cache dir")
    if report.status == "command_failed":
        lines.append(
            "  nothing was merged into the cache dir: the command failed before compiling"
            " anything (its first error line is above); fix the command and prewarm again"
        )
    if report.verify is not None:
        lines.append(format_verify(report.verify))
    return "\n".join(lines)
