"""The client and the pre-job hook must start without torch (they run on every job start)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import cachekeeper.client.api, cachekeeper.client.prejob, cachekeeper.client.pull
import cachekeeper.client.push
from cachekeeper.cli import main
try:
    main(["prejob", "--help"])
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "triton", "fastapi", "uvicorn", "rich") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


def test_client_and_prejob_help_do_not_import_torch_or_server_stack():
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "Pre-job hook" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY="


def test_public_names_resolve():
    import cachekeeper.client as client

    for name in client.__all__:
        assert isinstance(getattr(client, name), type), name
