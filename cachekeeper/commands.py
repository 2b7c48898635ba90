"""Run a workload's ``[[command]]`` (the site's own launcher) and collect per-process evidence.

``run_command(command, cache_dir=..., work=...)`` starts ``command.argv`` without a shell,
in ``command.cwd``, with the builder's environment plus exactly::

    command.env                          # what the workload says
    TORCHINDUCTOR_CACHE_DIR=<cache_dir>  # the staging (prewarm) or fresh (verify) dir
    TRITON_CACHE_DIR                     # removed: Triton's cache lands in <cache_dir>/triton
    TORCHINDUCTOR_REDIS_URL, ...         # the per-key tier's switches kept, never reached
                                         # (remote_tier.isolated: verify proves the dir alone)
    PYTHONPATH=<evidence hook>:$PYTHONPATH
    CACHEKEEPER_EVIDENCE_DIR=<work>/evidence-<mode>-<index>/

The evidence hook (``cachekeeper/_evidence_hook/sitecustomize.py``) makes every Python
process the command starts (torchrun's ranks included) write its rank, device, cache
counters and ending to that folder at exit; docs/workloads.md says why this and not
torch's structured trace. Output (stdout and stderr together) goes to
``<work>/log-<mode>-<index>.log``; its last lines are kept in the result, and before them
the first line that reads like an error when the tail no longer holds it (a launcher's
traceback after a rank's ``error: unrecognized arguments`` pushes that line out of it).

A cold run that exits non-zero having compiled nothing (no process loaded torch's compiler,
none raised, nothing in its cache dir: a usage error, a missing data file) is
``command_failed``, not ``cold_compile_broken``: it says nothing about the cold compile.

A timeout sends SIGTERM to every process of the command's tree (torchrun starts each rank
in its own session, so a process group is not enough), then SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from cachekeeper import config, remote_tier
from cachekeeper.verdicts import CommandRun, ErrorInfo, ProcessEvidence, Progress, ProgressEvent
from cachekeeper.workload import Command

__all__ = ["EVIDENCE_HOOK", "command_environ", "run_command", "read_evidence"]

EVIDENCE_HOOK = Path(__file__).resolve().parent / "_evidence_hook"
_LOG_TAIL_LINES = 40
_LOG_TAIL_BYTES = 64 * 1024
_TICK_S = 30.0  # a progress line this often while a command runs
# A line that reads like an error (argparse's "prog: error: ...", "ValueError: ...",
# "FATAL ..."); the first one is kept in the report even when the tail has scrolled past it.
_ERROR_LINE = re.compile(r"(?i)(\berror\b|\bfatal\b|\w(Error|Exception)\b)")
_ELIDED = "..."
_TERM_GRACE_S = 10.0


def command_environ(
    command: Command, *, cache_dir: Path, evidence: Path, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment ``command`` runs with (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.pop("TRITON_CACHE_DIR", None)
    env = remote_tier.isolated({**env, **command.env})  # the workload's switches too
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env[config.EVIDENCE_DIR] = str(evidence)
    previous = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(EVIDENCE_HOOK) + (os.pathsep + previous if previous else "")
    return env


def read_evidence(folder: Path) -> tuple[ProcessEvidence, ...]:
    """The records in ``folder``, ranks first in rank order, then by pid; bad files skipped."""
    found: list[ProcessEvidence] = []
    for path in sorted(folder.glob("proc-*.json")):
        try:
            found.append(ProcessEvidence.from_record(json.loads(path.read_text("utf-8"))))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return tuple(sorted(found, key=lambda p: (p.rank is None, p.rank or 0, p.pid)))


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


def _descendants(root: int) -> list[int]:
    """``root``'s live descendants (from /proc), children before their own children."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                raw = stat.read().decode("ascii", "replace")
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        fields = raw[raw.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    queue = [root]
    while queue:
        for child in children.get(queue.pop(0), []):
            out.append(child)
            queue.append(child)
    return out


def _signal_tree(proc: subprocess.Popen[bytes], sig: int) -> None:
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, sig)  # started with its own session: its group too
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the command's whole tree, wait a little, then SIGKILL what is left."""
    tree = [proc.pid, *_descendants(proc.pid)]
    _signal_tree(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=_TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for pid in tree + _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


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
) -> CommandRun:
    """Run ``command`` once against ``cache_dir``; never raises for what the command does.

    The bound is the command's own ``timeout`` or ``timeout_s``, whichever is shorter.
    """
    name = f"command[{index}]"
    evidence = work / f"evidence-{mode}-{index}"
    evidence.mkdir(parents=True, exist_ok=True)
    log_path = work / f"log-{mode}-{index}.log"
    env = command_environ(command, cache_dir=cache_dir, evidence=evidence)
    bounds = [t for t in (command.timeout_s, timeout_s) if t is not None]
    bound = min(bounds) if bounds else None
    label = command.describe(limit=80)
    started = time.monotonic()

    def emit(event: str, **extra: object) -> None:
        if progress is not None:
            elapsed = round(time.monotonic() - started, 3)
            progress(ProgressEvent("", mode, name, event, elapsed, **extra))  # type: ignore[arg-type]

    def failed(status: str, error: ErrorInfo, *, exit_code: int | None = None) -> CommandRun:
        return CommandRun(
            index=index,
            mode=mode,
            command=command.describe(),
            status=status,  # type: ignore[arg-type]
            seconds=round(time.monotonic() - started, 3),
            exit_code=exit_code,
            processes=read_evidence(evidence),
            log_tail=_log_tail(log_path),
            error=error,
        )

    cwd = Path(command.cwd).expanduser().absolute() if command.cwd else Path.cwd()
    if not cwd.is_dir():
        message = f"{name}.cwd: {cwd} is not a directory on this builder"
        return failed("invalid", ErrorInfo("CommandInvalid", message, f"{name}.cwd"))
    program = command.argv[0]
    if os.sep not in program and shutil.which(program, path=env.get("PATH")) is None:
        message = f"{name}.argv[0]: {program!r} is not found on PATH on this builder"
        return failed("invalid", ErrorInfo("CommandInvalid", message, f"{name}.argv"))
    emit("start", label=label)
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                list(command.argv),
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    except OSError as exc:
        message = f"{name}.argv[0]: cannot run {program!r}: {exc.strerror or exc}"
        return failed("invalid", ErrorInfo("CommandInvalid", message, f"{name}.argv"))
    deadline = None if bound is None else started + bound
    try:
        while True:
            wait = _TICK_S if deadline is None else min(_TICK_S, deadline - time.monotonic())
            try:
                proc.wait(timeout=max(0.0, wait))
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    _stop(proc)
                    message = f"no exit after {bound:.0f} s; stopped (SIGTERM, then SIGKILL)"
                    return failed("timeout", ErrorInfo("Timeout", message, name))
                emit("running", label=_last_line(log_path))
    except BaseException:
        _stop(proc)  # the agent asked to stop, or Ctrl-C: never leave ranks behind
        raise
    seconds = round(time.monotonic() - started, 3)
    emit("done", label=label, seconds=seconds)
    code = proc.returncode
    if code != 0:
        why = f"exited with status {code}" if code > 0 else f"killed by signal {-code}"
        processes = read_evidence(evidence)
        raised = next((p for p in processes if p.exit_status == "exception"), None)
        if raised is not None:
            why += f"; {raised.label} raised {raised.error}"
        output = _log_tail(log_path)
        tail = output[-20:] if _ELIDED not in output[:2] else (*output[:2], *output[-18:])
        if mode == "prewarm" and _compiled_nothing(processes, cache_dir):
            first = _first_error(list(output))
            why += " before compiling anything" + (f": {first}" if first else "")
            error = ErrorInfo("CommandFailed", why, name, traceback_tail=tail)
            return failed("command_failed", error, exit_code=code)
        error = ErrorInfo("CommandFailed", why, name, traceback_tail=tail)
        return failed("error", error, exit_code=code)
    return CommandRun(
        index=index,
        mode=mode,
        command=command.describe(),
        status="ok",
        seconds=seconds,
        exit_code=0,
        processes=read_evidence(evidence),
        log_tail=_log_tail(log_path),
    )
