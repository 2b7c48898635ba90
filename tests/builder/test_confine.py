"""The build supervisor (cachekeeper/builder/confine.py, cachekeeper/builder/_supervisor.py), real processes.

The reproducers of issue 32 (daemons that outlive a build, the signing key) are in
tests/hardening/test_contained_builds.py; these are the supervisor's own contracts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cachekeeper.builder.confine import Confinement, start

PY = sys.executable


def _start(tmp_path: Path, *argv: str, program: str | None = None, grace_s: float = 10.0):
    return start(
        list(argv),
        program=program,
        cwd=tmp_path,
        env=dict(os.environ),
        status=tmp_path / "status.json",
        confinement=Confinement(grace_s=grace_s),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_the_outcome_says_how_the_command_ended(tmp_path: Path) -> None:
    run = _start(tmp_path, PY, "-c", "import sys; sys.exit(7)")
    run.wait(60)
    assert run.outcome().returncode == 7 and run.outcome().left_running == ()
    killed = _start(tmp_path, PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    killed.wait(60)
    assert killed.outcome().signal == signal.SIGKILL and killed.outcome().returncode == -9
    # the program run is --program; argv[0] stays the process's own name
    named = _start(tmp_path, "my-launcher", "-c", "import sys; sys.exit(sys.argv[0] != '-c')",
                   program=PY)  # fmt: skip
    named.wait(60)
    assert named.outcome().returncode == 0
    missing = _start(tmp_path, "x", program=str(tmp_path / "no-such-program"))
    missing.wait(60)
    assert missing.outcome().error.startswith("cannot run 'x'"), missing.outcome()


def test_stop_ends_the_tree_and_a_killed_supervisor_is_told(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    )
    run = _start(tmp_path, PY, "-c", script, grace_s=1.0)
    while not pid_file.exists():
        time.sleep(0.05)
    child = int(pid_file.read_text())
    run.stop()
    assert run.outcome().stopped
    assert not Path(f"/proc/{child}").exists()
    pid_file.unlink()
    (tmp_path / "status.json").unlink()
    cut = _start(tmp_path, PY, "-c", script)
    while not pid_file.exists():
        time.sleep(0.05)
    os.kill(cut.pid, signal.SIGKILL)  # the supervisor itself is killed: no status
    cut.wait(60)
    assert "without a status" in cut.outcome().error
    os.kill(int(pid_file.read_text()), signal.SIGKILL)  # what it left, ours to end here
