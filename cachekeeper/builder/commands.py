"""Run a workload's ``[[command]]`` (the site's own launcher) and collect per-process evidence.

``run_command(command, cache_dir=..., work=...)`` starts ``command.argv`` without a shell,
in ``command.cwd``, under a supervisor (``cachekeeper.builder.confine``), with the builder's
environment (less ``CACHEKEEPER_TOKEN``: a build never holds the agent's token) plus exactly::

    command.env                          # what the workload says
    TORCHINDUCTOR_CACHE_DIR=<cache_dir>  # the staging (prewarm) or fresh (verify) dir
    TRITON_CACHE_DIR                     # removed: Triton's cache lands in <cache_dir>/triton
    TORCHINDUCTOR_REDIS_URL, ...         # the per-key tier's switches kept, never reached
                                         # (remote_tier.isolated: verify proves the dir alone)
    PYTHONPATH=<evidence hook>:$PYTHONPATH
    CACHEKEEPER_EVIDENCE_DIR=<work>/evidence-<mode>-<index>/

The program is the file ``cachekeeper.builder.programs.program_path`` finds (the one the allowlist
judged); ``argv[0]`` stays as written. The evidence hook
(``cachekeeper/builder/_evidence_hook/sitecustomize.py``) makes every Python process that imports
``torch._dynamo`` write a start record, then its rank, device, cache counters and ending
at exit; ``read_evidence`` pairs them, and a start without an end is a gap the verdict
counts (docs/workloads.md says why this and not torch's structured trace). Output (stdout
and stderr together) goes to ``<work>/log-<mode>-<index>.log``; its last lines are kept in
the result, and before them the first line that reads like an error when the tail no longer
holds it (a launcher's traceback after a rank's ``error: unrecognized arguments`` pushes
that line out of it).

A cold run that exits non-zero having compiled nothing (no process loaded torch's compiler,
none raised, nothing in its cache dir: a usage error, a missing data file) is
``command_failed``, not ``cold_compile_broken``: it says nothing about the cold compile.

The supervisor owns the whole tree (a child subreaper): what the command leaves running
when it ends, double-forked and ``setsid`` daemons included, is stopped and named in the
result; a timeout stops everything (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from cachekeeper import config, remote_tier
from cachekeeper.builder.confine import Confinement, start
from cachekeeper.builder.kinds.command_spec import Command
from cachekeeper.builder.programs import program_path
from cachekeeper.builder.verdicts import (
    CommandRun,
    ErrorInfo,
    ProcessEvidence,
    Progress,
    ProgressEvent,
)

__all__ = [
    "EVIDENCE_HOOK",
    "Evidence",
    "command_environ",
    "run_command",
    "read_evidence",
    "without_secrets",
]

EVIDENCE_HOOK = Path(__file__).resolve().parent / "_evidence_hook"
_LOG_TAIL_LINES = 40
_LOG_TAIL_BYTES = 64 * 1024
_TICK_S = 30.0  # a progress line this often while a command runs
# A line that reads like an error (argparse's "prog: error: ...", "ValueError: ...",
# "FATAL ..."); the first one is kept in the report even when the tail has scrolled past it.
_ERROR_LINE = re.compile(r"(?i)(\berror\b|\bfatal\b|\w(Error|Exception)\b)")
_ELIDED = "..."
_TERM_GRACE_S = 10.0
# The builder's own secrets: never in a build's environment.
SECRET_VARIABLES = (config.TOKEN,)


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the agent's token (a build's code never needs it)."""
    return {k: v for k, v in environ.items() if k not in SECRET_VARIABLES}


def command_environ(
    command: Command, *, cache_dir: Path, evidence: Path, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment ``command`` runs with (see the module docstring)."""
    env = without_secrets(os.environ if base is None else base)
    env.pop("TRITON_CACHE_DIR", None)
    env = remote_tier.isolated({**env, **command.env})  # the workload's switches too
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env[config.EVIDENCE_DIR] = str(evidence)
    previous = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(EVIDENCE_HOOK) + (os.pathsep + previous if previous else "")
    return env


class Evidence:
    """The records of an evidence folder, paired: ``processes`` (a start and an end record),
    ``gaps`` (one line per start without an end, or end without a start)."""

    def __init__(self, processes: tuple[ProcessEvidence, ...], gaps: tuple[str, ...]) -> None:
        self.processes = processes
        self.gaps = gaps


def _json_records(folder: Path, prefix: str) -> dict[int, dict[str, object]]:
    found: dict[int, dict[str, object]] = {}
    for path in sorted(folder.glob(f"{prefix}-*.json")):
        try:
            raw = json.loads(path.read_text("utf-8"))
            found[int(raw["pid"])] = raw
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def read_evidence(folder: Path) -> Evidence:
    """The folder's records, ranks first in rank order, then by pid; unreadable files
    skipped. An end record counts only with the start record the hook wrote first."""
    starts = _json_records(folder, "start")
    ends = _json_records(folder, "proc")
    found: list[ProcessEvidence] = []
    gaps: list[str] = []
    for pid, raw in ends.items():
        if pid not in starts:
            gaps.append(
                f"an end record for pid {pid} has no start record: cachekeeper's evidence"
                " hook did not write it"
            )
            continue
        try:
            found.append(ProcessEvidence.from_record(raw))
        except (ValueError, KeyError, TypeError):
            gaps.append(f"the end record of pid {pid} cannot be read")
    for pid, raw in starts.items():
        if pid not in ends:
            argv = raw.get("argv")
            words = " ".join(str(a) for a in argv)[:100] if isinstance(argv, list) else ""
            gaps.append(
                f"pid {pid} ({words}) imported torch._dynamo and left no end record: it was"
                " killed or ended below Python, so what it compiled is unknown"
            )
    ordered = sorted(found, key=lambda p: (p.rank is None, p.rank or 0, p.pid))
    return Evidence(tuple(ordered), tuple(sorted(gaps)))


def _log_tail(path: Path) -> tuple[str, ...]:
    """The log's last lines; preceded by its first error line and ``...`` when the tail
    does not hold that line (see the module docstring)."""
    try:
        with open(path, "rb") as log:
            head = log.read(_LOG_TAIL_BYTES).decode("utf-8", "replace")
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - _LOG_TAIL_BYTES))
            text = log.read().decode("utf-8", "replace")
    except OSError:
        return ()
    lines = text.splitlines()
    if size > _LOG_TAIL_BYTES and lines:
        lines = lines[1:]  # the first one is cut
    tail = [line[:500] for line in lines[-_LOG_TAIL_LINES:]]
    first = _first_error(head.splitlines()[:-1] if size > _LOG_TAIL_BYTES else lines)
    if first is not None and first[:500] not in tail:
        return (first[:500], _ELIDED, *tail[1:])
    return tuple(tail)


def _first_error(lines: list[str]) -> str | None:
    """The first line that reads like an error (not a traceback's header), if any."""
    return next(
        (ln for ln in lines if _ERROR_LINE.search(ln) and not ln.startswith("Traceback")), None
    )


def _compiled_nothing(processes: tuple[ProcessEvidence, ...], cache_dir: Path) -> bool:
    """No process looked anything up or raised after loading torch's compiler, and the
    cache dir the command ran against holds no file: the run never reached a compile."""
    if any(p.compiled or p.exit_status == "exception" for p in processes):
        return False
    for _folder, _dirs, files in os.walk(cache_dir):
        if files:
            return False
    return True


def _last_line(path: Path) -> str:
    tail = _log_tail(path)
    return tail[-1][:120] if tail else ""


def run_command(
    command: Command,
    *,
    index: int,
    mode: str,
    cache_dir: Path,
    work: Path,
    progress: Progress | None = None,
    timeout_s: float | None = None,
    confinement: Confinement | None = None,
) -> CommandRun:
    """Run ``command`` once against ``cache_dir``; never raises for what the command does.

    The bound is the command's own ``timeout`` or ``timeout_s``, whichever is shorter.
    ``confinement`` (default: reaped, nothing hidden) is what its processes are held to.
    """
    confinement = confinement or Confinement()
    name = f"command[{index}]"
    evidence = work / f"evidence-{mode}-{index}"
    evidence.mkdir(parents=True, exist_ok=True)
    log_path = work / f"log-{mode}-{index}.log"
    status_path = work / f"supervisor-{mode}-{index}.json"
    env = command_environ(command, cache_dir=cache_dir, evidence=evidence)
    bounds = [t for t in (command.timeout_s, timeout_s) if t is not None]
    bound = min(bounds) if bounds else None
    label = command.describe(limit=80)
    started = time.monotonic()

    def emit(event: str, **extra: object) -> None:
        if progress is not None:
            elapsed = round(time.monotonic() - started, 3)
            progress(ProgressEvent("", mode, name, event, elapsed, **extra))  # type: ignore[arg-type]

    def result(
        status: str,
        *,
        error: ErrorInfo | None = None,
        exit_code: int | None = None,
        left_running: tuple[str, ...] = (),
        sandbox: str = "",
    ) -> CommandRun:
        found = read_evidence(evidence)
        return CommandRun(
            index=index,
            mode=mode,
            command=command.describe(),
            status=status,  # type: ignore[arg-type]
            seconds=round(time.monotonic() - started, 3),
            exit_code=exit_code,
            processes=found.processes,
            log_tail=_log_tail(log_path),
            error=error,
            gaps=found.gaps,
            left_running=left_running,
            sandbox=sandbox,
        )

    cwd = Path(command.cwd).expanduser().absolute() if command.cwd else Path.cwd()
    if not cwd.is_dir():
        message = f"{name}.cwd: {cwd} is not a directory on this builder"
        return result("invalid", error=ErrorInfo("CommandInvalid", message, f"{name}.cwd"))
    program = command.argv[0]
    resolved = program_path(program, cwd=cwd, path=env.get("PATH"))
    if resolved is None:
        message = f"{name}.argv[0]: {program!r} is not found on PATH on this builder"
        return result("invalid", error=ErrorInfo("CommandInvalid", message, f"{name}.argv"))
    emit("start", label=label)
    try:
        with open(log_path, "wb") as log:
            run = start(
                command.argv,
                program=resolved,
                cwd=cwd,
                env=env,
                status=status_path,
                confinement=confinement,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    except OSError as exc:
        message = f"{name}: cannot start the build's supervisor: {exc.strerror or exc}"
        return result("invalid", error=ErrorInfo("CommandInvalid", message, name))
    deadline = None if bound is None else started + bound
    try:
        while True:
            wait = _TICK_S if deadline is None else min(_TICK_S, deadline - time.monotonic())
            try:
                run.wait(timeout=max(0.0, wait))
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    run.stop()
                    message = f"no exit after {bound:.0f} s; stopped (SIGTERM, then SIGKILL)"
                    return result("timeout", error=ErrorInfo("Timeout", message, name))
                emit("running", label=_last_line(log_path))
    except BaseException:
        run.stop()  # the agent asked to stop, or Ctrl-C: never leave ranks behind
        raise
    outcome = run.outcome()
    seconds = round(time.monotonic() - started, 3)
    emit("done", label=label, seconds=seconds)
    stray = outcome.left_running + tuple(f"{p} (would not die)" for p in outcome.unkillable)
    if outcome.error:
        kind = "invalid" if outcome.returncode is None and not outcome.stopped else "error"
        where = f"{name}.argv" if outcome.error.startswith("cannot run") else name
        error = ErrorInfo(
            "CommandInvalid" if kind == "invalid" else "CommandFailed", outcome.error, where
        )
        return result(kind, error=error, left_running=stray, sandbox=outcome.sandbox)
    code = outcome.returncode
    if code != 0:
        why = (
            f"exited with status {code}"
            if code is not None and code > 0
            else (f"killed by signal {-code}" if code is not None else "stopped")
        )
        processes = read_evidence(evidence).processes
        raised = next((p for p in processes if p.exit_status == "exception"), None)
        if raised is not None:
            why += f"; {raised.label} raised {raised.error}"
        output = _log_tail(log_path)
        tail = output[-20:] if _ELIDED not in output[:2] else (*output[:2], *output[-18:])
        status = "error"
        if mode == "prewarm" and _compiled_nothing(processes, cache_dir):
            first = _first_error(list(output))
            why += " before compiling anything" + (f": {first}" if first else "")
            status = "command_failed"
        error = ErrorInfo("CommandFailed", why, name, traceback_tail=tail)
        return result(
            status, error=error, exit_code=code, left_running=stray, sandbox=outcome.sandbox
        )
    return result("ok", exit_code=0, left_running=stray, sandbox=outcome.sandbox)
