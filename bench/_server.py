"""The benchmarks' one way to run ``cachekeeper serve``: a fresh process on a free loopback
port, up once ``/healthz`` answers, stopped on leaving the block.

    with serve(work / "data", args=["--blob-store", url], env={"AWS_...": ...}) as server:
        httpx.get(f"{server.url}/v1/snapshots")
        cpu = cpu_seconds(server.proc.pid)

The server gets this process's environment without its ``CACHEKEEPER_*`` variables (so a
developer's shell settings do not leak into a measurement), then ``env`` on top. Its
stdout and stderr go to ``log`` (a file kept for the caller) or to a temporary file whose
tail is in the error when the server does not come up. Tokens, an object store, limits:
``args`` (``["--token", "NAME:SECRET:write"]``) or ``env``. ``CK_ARGS`` is how every bench
runs the CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from tests.helpers.ports import free_port

__all__ = ["CK_ARGS", "BenchServer", "cpu_seconds", "serve"]

_SCRIPT = Path(sys.executable).parent / "cachekeeper"
# The console script beside this interpreter (a venv's), else the same entry point via -m.
CK_ARGS = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "cachekeeper"]
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (/proc/<pid>/stat fields 14 and 15; 10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@dataclass(frozen=True)
class BenchServer:
    url: str  # http://127.0.0.1:PORT
    port: int
    proc: subprocess.Popen[bytes]


@contextmanager
def serve(
    data: Path,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    cwd: Path | None = None,
    start_timeout_s: float = 60.0,
) -> Iterator[BenchServer]:
    """``cachekeeper serve --data DATA`` plus ``args`` on 127.0.0.1, until the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [*CK_ARGS, "serve", "--host", "127.0.0.1", "--port", str(port), "--data", str(data)]
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKEEPER_")}
    server_env.update(env or {})
    with ExitStack() as stack:
        out: IO[bytes] = stack.enter_context(
            open(log, "w+b") if log is not None else tempfile.TemporaryFile()  # noqa: SIM115
        )
        proc = subprocess.Popen(
            [*command, *args], env=server_env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT
        )
        stack.callback(_stop, proc)
        _wait_healthy(url, proc, out, timeout_s=start_timeout_s)
        yield BenchServer(url=url, port=port, proc=proc)


def _wait_healthy(
    url: str, proc: subprocess.Popen[bytes], out: IO[bytes], *, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    out.flush()
    out.seek(0)
    tail = out.read().decode(errors="replace")[-2000:]
    state = (
        f"exited {proc.returncode}"
        if proc.poll() is not None
        else f"no answer in {timeout_s:.0f} s"
    )
    raise RuntimeError(f"cachekeeper serve did not come up at {url} ({state}):\n{tail}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
