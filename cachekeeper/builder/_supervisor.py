"""The process that owns a build's process tree: reaps all of it, and sandboxes it.

    python -I -m cachekeeper.builder._supervisor --status OUT.json --parent PID --grace S \
        [--hide FILE]... [--program PATH] -- ARGV...

(``cachekeeper.builder.confine.start`` runs ``main`` the same way through ``python -I -c``, with the
folder of the agent's own ``cachekeeper`` first on ``sys.path``.)

Started by ``cachekeeper.builder.confine.start`` for every command run and every prewarm or verify
child. It makes itself a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux 3.4,
unprivileged), so every process the command starts, and every orphan of a double fork or a
``setsid`` daemon, stays its descendant. Then:

1. with ``--hide``, it prepares a Landlock ruleset (``cachekeeper.builder.landlock``) that hides
   those files, and the command enters it between fork and exec: the command and all it
   starts can neither read nor replace them. The supervisor itself stays outside, so that
   (from Landlock ABI 6) no sandboxed process can signal or ptrace it;
2. it starts ``ARGV`` (``--program`` the file it executes, ``ARGV[0]`` as the process's own
   name), with its own stdin, stdout, stderr, cwd and environment;
3. it waits. When the command's main process ends, whatever it left running is stopped:
   SIGTERM to every descendant, a short grace, then SIGKILL until none is left, and every
   one is reaped. On SIGTERM (the agent's timeout or stop) or when its parent dies
   (``PR_SET_PDEATHSIG``), the same for the whole tree, main process included, with
   ``--grace`` seconds between SIGTERM and SIGKILL;
4. it writes ``--status`` (temp file + rename) and exits 0::

    {"exit_code": int | null, "signal": int | null, "stopped": bool,
     "left_running": ["python -c ... (pid 123)", ...], "unkillable": [...],
     "sandbox": "Landlock ABI 7, 1 path(s) hidden, 212 rules" | "", "error": ""}

``-I``: the command's environment (its ``PYTHONPATH`` and loader variables) never reaches
the supervisor's own Python. Stdlib and ``cachekeeper.builder.landlock`` / ``cachekeeper._proc``
only: it starts in well under a second.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Any

from cachekeeper._proc import descendants, process_name
from cachekeeper.builder import landlock

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_LEFTOVER_GRACE_S = 2.0  # what a command left running gets between SIGTERM and SIGKILL
_KILL_PATIENCE_S = 30.0  # a process in uninterruptible sleep can take a while to die


class _Stop(Exception):
    """Raised by the signal handler out of the wait: stop the whole tree."""


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0):
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signum)


def _reap(*, until: float) -> bool:
    """Reap children until none is left (True) or ``until`` passes (False)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            if time.monotonic() >= until:
                return False
            time.sleep(0.02)


def _signal_all(sig: int) -> list[int]:
    pids = descendants(os.getpid())
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def _stop_tree(grace_s: float) -> list[str]:
    """SIGTERM every descendant, wait ``grace_s``, then SIGKILL until none is left; the
    processes that would not die (named), if any."""
    if not _signal_all(signal.SIGTERM):
        _reap(until=time.monotonic())
        return []
    if _reap(until=time.monotonic() + grace_s):
        return []
    give_up = time.monotonic() + _KILL_PATIENCE_S
    while True:
        left = _signal_all(signal.SIGKILL)  # again each time: a fork may have raced us
        if _reap(until=min(give_up, time.monotonic() + 0.5)):
            return []
        if time.monotonic() >= give_up:
            return [process_name(pid) for pid in left]


def _write(path: str, status: dict[str, Any]) -> None:
    temp = f"{path}.tmp"
    with open(temp, "w", encoding="utf-8") as out:
        json.dump(status, out)
    os.replace(temp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachekeeper.builder._supervisor")
    parser.add_argument("--status", required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--hide", action="append", default=[])
    parser.add_argument("--program", default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    status: dict[str, Any] = {
        "exit_code": None,
        "signal": None,
        "stopped": False,
        "left_running": [],
        "unkillable": [],
        "sandbox": "",
        "error": "",
    }
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_signal)
    try:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != args.parent:  # it died before PDEATHSIG was armed
            raise _Stop(signal.SIGTERM)
        ruleset = landlock.prepare(args.hide) if args.hide else None
    except (OSError, ValueError) as exc:
        status["error"] = f"cannot confine the build: {exc}"
        _write(args.status, status)
        return 0
    except _Stop:
        status["stopped"] = True
        _write(args.status, status)
        return 0
    if ruleset is not None:
        status["sandbox"] = ruleset.describe()
    try:
        try:
            proc = subprocess.Popen(
                command,
                executable=args.program,
                preexec_fn=(lambda: landlock.enter(ruleset)) if ruleset else None,  # noqa: PLW1509
                pass_fds=(),
                restore_signals=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            status["error"] = f"cannot run {command[0]!r}: {getattr(exc, 'strerror', None) or exc}"
            return 0
        finally:
            if ruleset is not None:
                os.close(ruleset.fd)
        while True:
            pid, wait_status = os.waitpid(-1, 0)
            if pid == proc.pid:
                proc.returncode = os.waitstatus_to_exitcode(wait_status)
                break
        code = proc.returncode
        status["exit_code"] = code if code >= 0 else None
        status["signal"] = -code if code < 0 else None
        left = descendants(os.getpid())
        status["left_running"] = [process_name(pid) for pid in left]
        status["unkillable"] = _stop_tree(_LEFTOVER_GRACE_S)
    except _Stop:
        status["stopped"] = True
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup
        status["unkillable"] = _stop_tree(args.grace)
    finally:
        _write(args.status, status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
