"""How the processes of a build are held: one supervisor per process tree, and what it hides.

Every command run (``cachekeeper.builder.commands``) and every prewarm or verify child
(``cachekeeper.builder.children``) is started through ``start()``: a supervisor process
(``cachekeeper/builder/_supervisor.py``) that is a child subreaper, so double-forked and ``setsid``
daemons stay in its tree and are stopped at a timeout, at a stop, and when the command ends
normally. ``Confinement`` says what else a build's processes are held to:

- ``hidden``: files no process of the build may read or replace (the agent's signing key),
  through Landlock (``cachekeeper.builder.landlock``). Empty for ``cachekeeper prewarm``
  run by hand.
  Every folder on the way to a hidden file is closed to new entries; when the temp folder
  (``$TMPDIR``, else ``/tmp``) is one of them, the build gets a ``TMPDIR`` of its own next
  to its status file (compilers and ``tempfile`` write there).
- ``defined_imports``: an import path must name a ``def`` or ``class`` of its module
  (``cachekeeper.builder.allowlist.check_defined``, checked in the child before anything is
  imported). The agent sets it: that is its allowlist's rule.

The agent side of a supervised run is ``Supervised``: ``wait``, ``stop`` (SIGTERM to the
supervisor, which stops the tree; SIGKILL to it and a sweep of its descendants if it does
not answer) and ``outcome()`` (what the supervisor wrote).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cachekeeper._proc import descendants

__all__ = ["Confinement", "Supervised", "SupervisorOutcome", "start"]

_SUPERVISOR_SLACK_S = 20.0  # past the grace, how long the supervisor may take to clean up
# The supervisor runs isolated (-I: the build's PYTHONPATH and loader variables never reach
# its Python) from the very cachekeeper this process runs, installed or not.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds cachekeeper/
_RUN_SUPERVISOR = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from cachekeeper.builder._supervisor import main; sys.exit(main(sys.argv[1:]))"
)


@dataclass(frozen=True)
class Confinement:
    """What the processes of a build are held to (see the module docstring)."""

    hidden: tuple[Path, ...] = ()
    defined_imports: bool = False
    grace_s: float = 10.0  # between SIGTERM and SIGKILL when a build is stopped


@dataclass(frozen=True)
class SupervisorOutcome:
    """What the supervisor saw: how the main process ended and what it left running."""

    exit_code: int | None  # None: killed by a signal, stopped, or never started
    signal: int | None = None
    stopped: bool = False
    left_running: tuple[str, ...] = ()  # processes still running when the main one ended
    unkillable: tuple[str, ...] = ()  # processes that would not die
    sandbox: str = ""
    error: str = ""  # the build could not be confined or started

    @property
    def returncode(self) -> int | None:
        """As ``Popen.returncode``: the exit status, or minus the signal."""
        if self.exit_code is not None:
            return self.exit_code
        return -self.signal if self.signal is not None else None

    @classmethod
    def read(cls, path: Path) -> SupervisorOutcome | None:
        try:
            raw: dict[str, Any] = json.loads(path.read_text("utf-8"))
        except (OSError, ValueError):
            return None
        return cls(
            exit_code=raw.get("exit_code"),
            signal=raw.get("signal"),
            stopped=bool(raw.get("stopped")),
            left_running=tuple(raw.get("left_running") or ()),
            unkillable=tuple(raw.get("unkillable") or ()),
            sandbox=str(raw.get("sandbox") or ""),
            error=str(raw.get("error") or ""),
        )


class Supervised:
    """A process tree under its supervisor, from the side that started it."""

    def __init__(self, proc: subprocess.Popen[bytes], *, status: Path, grace_s: float) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.status = status
        self.grace_s = grace_s

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the supervisor (subprocess.TimeoutExpired after ``timeout``)."""
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """Stop the whole tree: the supervisor does it on SIGTERM; if it does not finish in
        time (or was killed), SIGKILL it and every process still below it."""
        if self.proc.poll() is not None:
            return
        tree = descendants(self.pid)
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=self.grace_s + _SUPERVISOR_SLACK_S)
            return
        except subprocess.TimeoutExpired:
            pass
        for pid in [self.pid, *tree, *descendants(self.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()

    def outcome(self) -> SupervisorOutcome:
        """What the supervisor wrote; when it wrote nothing (it was killed), says so."""
        found = SupervisorOutcome.read(self.status)
        if found is not None:
            return found
        code = self.proc.poll()
        how = f"signal {-code}" if code is not None and code < 0 else f"status {code}"
        return SupervisorOutcome(
            exit_code=None,
            error=f"the build's supervisor ended ({how}) without a status: its tree may be"
            " left running",
        )


def _temp_on_the_way(env: Mapping[str, str], hidden: Sequence[Path]) -> bool:
    """Whether the temp folder is a folder on the way to a hidden file (closed to new
    entries in the sandbox)."""
    temp = os.path.realpath(env.get("TMPDIR") or "/tmp")
    return any(os.path.realpath(h).startswith(temp.rstrip("/") + "/") for h in hidden)


def start(
    argv: Sequence[str],
    *,
    program: str | None = None,
    cwd: Path | str | None,
    env: Mapping[str, str],
    status: Path,
    confinement: Confinement,
    stdout: IO[bytes] | int | None,
    stderr: IO[bytes] | int | None,
) -> Supervised:
    """Start ``argv`` under a supervisor (its own session, stdin from /dev/null).

    OSError when the supervisor itself cannot start; whatever happens to ``argv`` is in
    ``outcome()``.
    """
    env = dict(env)
    if _temp_on_the_way(env, confinement.hidden):
        private = status.parent / f"tmp-{status.stem}"
        private.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(private)
    command = [
        sys.executable, "-I", "-c", _RUN_SUPERVISOR, _PACKAGE_ROOT,
        "--status", str(status), "--parent", str(os.getpid()),
        "--grace", str(confinement.grace_s),
    ]  # fmt: skip
    for path in confinement.hidden:
        command += ["--hide", str(path)]
    if program is not None:
        command += ["--program", program]
    command += ["--", *argv]
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,  # Ctrl-C reaches the agent, which stops the tree
    )
    return Supervised(proc, status=status, grace_s=confinement.grace_s)
