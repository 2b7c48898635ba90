"""The shell snippets of docs/hooks.md, taken from the doc itself and run with bash.

A snippet users copy must do what the doc says; a test of a copy of it would not notice
the doc drifting, so the test reads the code block out of the Markdown.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOOKS_MD = REPO / "docs" / "hooks.md"
BIN = Path(sys.executable).parent


def ck_torchrun_snippet() -> str:
    """The bash block under "## torchrun wrapper" in docs/hooks.md."""
    text = HOOKS_MD.read_text()
    section = text.split("## torchrun wrapper", 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match is not None, "docs/hooks.md lost the ck-torchrun block"
    script = match.group(1)
    assert "# ck-torchrun" in script
    return script


def _run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def wrapper(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    script = tmp_path / "ck-torchrun"
    script.write_text(ck_torchrun_snippet())
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_"))
    }
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["CACHEKEEPER_HOME"] = str(tmp_path / "ck-home")
    return script, env


def test_ck_torchrun_stops_with_a_message_when_the_workload_is_unset(
    wrapper: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    script, env = wrapper
    marker = tmp_path / "torchrun-ran"
    # A torchrun that records that it ran: the claim is that it is never reached.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "torchrun").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (fake_bin / "torchrun").chmod(0o755)
    env["PATH"] = f"{fake_bin}{os.pathsep}{env['PATH']}"
    proc = _run(script, env, "train.py")
    assert proc.returncode != 0
    assert "CACHEKEEPER_WORKLOAD" in proc.stderr
    assert "set CACHEKEEPER_WORKLOAD" in proc.stderr
    assert not marker.exists(), "torchrun started although the workload was unset"


def test_ck_torchrun_runs_torchrun_with_the_hook_exports(
    wrapper: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """With no server the hook starts cold but still exports; the real torchrun sees it."""
    if shutil.which("torchrun", path=wrapper[1]["PATH"]) is None:
        pytest.skip("torchrun is not installed")
    script, env = wrapper
    env["CACHEKEEPER_WORKLOAD"] = "drafter-gqa"
    cache = tmp_path / "cache dir"  # a space: the export must be quoted
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint('TICD=' + os.environ['TORCHINDUCTOR_CACHE_DIR'])\n")
    proc = _run(script, env, "--nproc-per-node", "1", "--standalone", str(probe))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"TICD={cache}" in proc.stdout
    assert "this job will compile cold" in proc.stderr
    assert "cachekeeper: postjob:" in proc.stderr  # the epilog ran, after the job


def test_ck_torchrun_keeps_the_jobs_exit_status(
    wrapper: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The post-job line runs after a failed job and the job's status is the wrapper's."""
    script, env = wrapper
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "torchrun").write_text("#!/bin/sh\nexit 3\n")
    (fake_bin / "torchrun").chmod(0o755)
    env["PATH"] = f"{fake_bin}{os.pathsep}{env['PATH']}"
    env["CACHEKEEPER_WORKLOAD"] = "drafter-gqa"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "cache")
    proc = _run(script, env, "train.py")
    assert proc.returncode == 3, proc.stderr
    assert "cachekeeper: postjob:" in proc.stderr
