"""Hiding files from a build's processes (cachekeeper/builder/landlock.py), in real child processes.

This host has Landlock (Linux >= 5.19); the test of a host without it refuses the syscall
with a seccomp filter (tests/helpers/seccomp.py), as an older kernel or a container does.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

from cachekeeper.builder import landlock
from tests.helpers import seccomp

_TRY = """
import os, sys
for op in sys.argv[1:]:
    kind, path = op.split("=", 1)
    try:
        if kind == "read":
            open(path, "rb").read()
        elif kind == "write":
            open(path, "w").write("x")
        elif kind == "rename":
            os.rename(path, path + ".moved")
        print(op, "ok")
    except OSError as exc:
        print(op, "denied", exc.errno)
"""


def _run_confined(hidden: list[Path], *ops: str) -> dict[str, str]:
    ruleset = landlock.prepare(hidden)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _TRY, *ops],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=lambda: landlock.enter(ruleset),  # noqa: PLW1509
        )
    finally:
        os.close(ruleset.fd)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(" ")[:2] for line in proc.stdout.splitlines())


def test_a_hidden_file_cannot_be_read_written_or_moved(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    key = keys / "builder.key"
    key.write_text("secret")
    (keys / "builder.pub").write_text("public")
    work = tmp_path / "work"
    work.mkdir()
    seen = _run_confined(
        [key],
        f"read={key}",
        f"read={keys}/../keys/builder.key",
        f"read=/proc/self/root{key}",
        f"write={key}",
        f"rename={key}",
        f"read={keys / 'builder.pub'}",
        f"write={work / 'new'}",
        f"write={tmp_path / 'beside-the-keys'}",  # a folder on the way takes no new entry
    )
    assert seen == {
        f"read={key}": "denied",
        f"read={keys}/../keys/builder.key": "denied",
        f"read=/proc/self/root{key}": "denied",
        f"write={key}": "denied",
        f"rename={key}": "denied",
        f"read={keys / 'builder.pub'}": "ok",
        f"write={work / 'new'}": "ok",
        f"write={tmp_path / 'beside-the-keys'}": "denied",
    }
    assert key.read_text() == "secret"


def test_a_host_without_landlock_says_so() -> None:
    refuse = seccomp.refusing({"landlock_create_ruleset": errno.ENOSYS})
    show = "from cachekeeper.builder import landlock; print(landlock.unavailable_reason())"
    proc = subprocess.run(
        [sys.executable, "-c", show], capture_output=True, text=True, timeout=60,
        preexec_fn=refuse,  # noqa: PLW1509
    )  # fmt: skip
    assert proc.stdout.startswith("Landlock is not available"), proc.stdout + proc.stderr
    assert landlock.unavailable_reason() is None  # here, it is
