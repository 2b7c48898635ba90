"""push / pull / prejob option handling (cli/transfer.py); the transfers themselves are in
tests/client and tests/e2e."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _prejob(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "CACHEKEEPER_HOME": str(tmp_path / "home")}
    return subprocess.run(
        [sys.executable, "-m", "cachekeeper", "prejob", "--workload", "w", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_devices_is_a_deprecated_spelling_noted_on_stderr_only(tmp_path: Path) -> None:
    cache = str(tmp_path / "c")
    new = _prejob(tmp_path, "--cache-dir", cache, "--device", "cuda:0,1")
    old = _prejob(tmp_path, "--cache-dir", cache, "--devices", "cuda:0,cuda:1")
    assert new.returncode == old.returncode == 0, old.stderr
    assert "deprecated" not in new.stderr
    assert old.stderr.splitlines()[0] == (
        "cachekeeper: --devices is deprecated; use --device (e.g. --device cuda:0,1)"
    )
    assert old.stdout == new.stdout and "TORCHINDUCTOR_CACHE_DIR" in old.stdout


def test_bad_device_and_both_spellings_are_usage_errors(tmp_path: Path) -> None:
    bad = _prejob(tmp_path, "--device", "tpu")
    assert bad.returncode == 2 and "--device" in bad.stderr and "'tpu'" in bad.stderr
    both = _prejob(tmp_path, "--device", "cpu", "--devices", "cpu")
    assert both.returncode == 2 and "--devices is its deprecated spelling" in both.stderr
