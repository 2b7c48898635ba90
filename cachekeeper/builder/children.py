"""Run a workload in fresh child processes, one per device, and collect their results.

Prewarm and verify both run here: each child is ``python -m cachekeeper.builder._child`` with its
own ``TORCHINDUCTOR_CACHE_DIR`` (``TRITON_CACHE_DIR`` removed, so Triton's cache lands in
``<cache dir>/triton/<index>``), under a supervisor (``cachekeeper.builder.confine``: the child runs
workload code, an entrypoint or a factory, so it is reaped and sandboxed as a command is).
The work area is a temp folder next to the cache dir (same filesystem), removed when done::

    <cache_dir parent>/.cachekeeper-prewarm-XXXX/
      workload.toml               # the workload text the children read
      staging-cuda_0/             # prewarm: cuda:0's empty-at-start TORCHINDUCTOR_CACHE_DIR
      result-<mode>-cuda_0.json   # cuda:0's result (see cachekeeper.builder._child)
      stdout-<mode>-cuda_0.log    # what the workload printed
      supervisor-<mode>-cuda_0.json  # how its process tree ended (cachekeeper.builder.confine)
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachekeeper import remote_tier
from cachekeeper.builder._child import PROGRESS_PREFIX
from cachekeeper.builder.commands import without_secrets
from cachekeeper.builder.confine import Confinement, start
from cachekeeper.builder.verdicts import DeviceRun, ErrorInfo, Progress, ProgressEvent
from cachekeeper.builder.workload import Workload
from cachekeeper.environment import cpu
from cachekeeper.errors import PrewarmFailed

if TYPE_CHECKING:
    from cachekeeper.environment.fingerprint import CpuState

__all__ = ["work_area", "run_children", "slug", "child_environ", "child_cpu_state"]

_STDERR_TAIL = 40


class work_area:
    """A temp folder next to ``cache_dir`` (created with its parents), removed on exit."""

    def __init__(self, cache_dir: Path) -> None:
        self.parent = cache_dir.parent

    def __enter__(self) -> Path:
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=".cachekeeper-prewarm-", dir=self.parent))
        except OSError as exc:
            raise PrewarmFailed(
                f"cannot create a work area in {self.parent}: {exc.strerror}"
            ) from exc
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def child_environ(omp_num_threads: int | None) -> dict[str, str]:
    """The environment of a prewarm or verify child: ours, with the workload's [process].

    ``omp_num_threads`` (the workload's ``[process] omp_num_threads``) sets both
    ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` (torch takes MKL's first): Inductor's CPU
    kernels are keyed on the thread count, so the child compiles as training's ranks do.
    The per-key tier's switches are kept (two are in torch's keys) but the tier is never
    reached (``remote_tier.isolated``): verify proves the local dir alone.
    """
    env = {
        k: v
        for k, v in remote_tier.isolated(without_secrets(os.environ)).items()
        if k != "TRITON_CACHE_DIR"
    }
    if omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(omp_num_threads)
    return env


def child_cpu_state(omp_num_threads: int | None) -> CpuState:
    """The CPU state (``cachekeeper.environment.cpu.state``) a child with ``omp_num_threads`` compiles
    under: the ``cpu`` field of the fingerprint of every cache a prewarm of it builds."""
    return cpu.state(child_environ(omp_num_threads))


def slug(device: str) -> str:
    return device.replace(":", "_")


class _Child:
    """One running child process and the thread that relays its stderr."""

    def __init__(
        self,
        *,
        device: str,
        mode: str,
        cache_dir: Path,
        work: Path,
        source: str,
        progress: Progress | None,
        omp_num_threads: int | None,
        confinement: Confinement,
    ) -> None:
        self.device = device
        self.mode = mode
        self.result_path = work / f"result-{mode}-{slug(device)}.json"
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL)
        self.progress = progress
        env = child_environ(omp_num_threads)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        command = [
            sys.executable, "-m", "cachekeeper.builder._child",
            "--workload", str(work / "workload.toml"), "--source", source,
            "--device", device, "--mode", mode, "--result", str(self.result_path),
        ]  # fmt: skip
        if confinement.defined_imports:
            command.append("--defined-imports")
        self.started = time.monotonic()
        with open(work / f"stdout-{mode}-{slug(device)}.log", "wb") as stdout:
            self.run = start(
                command,
                cwd=None,
                env=env,
                status=work / f"supervisor-{mode}-{slug(device)}.json",
                confinement=confinement,
                stdout=stdout,
                stderr=subprocess.PIPE,
            )
        self.proc = self.run.proc
        self.reader = threading.Thread(target=self._relay, daemon=True)
        self.reader.start()

    def _relay(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith(PROGRESS_PREFIX):
                if self.progress is not None:
                    try:
                        event = json.loads(line[len(PROGRESS_PREFIX) :])
                        event.pop("counters", None)
                        self.progress(ProgressEvent(**event))
                    except (ValueError, TypeError):
                        pass
            else:
                self.stderr_tail.append(line)

    def kill(self) -> None:
        """Stop the child's whole tree (compile workers included), if any is left."""
        self.run.stop()

    def wait(self, deadline: float | None) -> DeviceRun:
        timed_out = False
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
        self.reader.join(timeout=10)
        seconds = time.monotonic() - self.started
        tail = tuple(self.stderr_tail)[-20:]
        if timed_out:
            return self._failed(
                "timeout",
                ErrorInfo("Timeout", f"no result after {seconds:.0f} s; killed", "", tail),
                seconds,
            )
        outcome = self.run.outcome()
        if outcome.error:
            return self._failed(
                "crashed", ErrorInfo("ChildCrashed", outcome.error, "", tail), seconds
            )
        try:
            raw = json.loads(self.result_path.read_text("utf-8"))
            return DeviceRun.from_result(raw, seconds=seconds)
        except (OSError, ValueError, KeyError, TypeError):
            message = f"exited with status {outcome.returncode} without a result"
            return self._failed("crashed", ErrorInfo("ChildCrashed", message, "", tail), seconds)

    def _failed(self, status: Any, error: ErrorInfo, seconds: float) -> DeviceRun:
        return DeviceRun(
            device=self.device,
            mode=self.mode,
            status=status,
            seconds=round(seconds, 3),
            error=error,
        )


def run_children(
    workload: Workload,
    cache_dirs: dict[str, Path],
    *,
    mode: str,
    work: Path,
    progress: Progress | None,
    timeout_s: float | None,
    confinement: Confinement | None = None,
) -> list[DeviceRun]:
    """One child per device, all at once; wait for every one (each within ``timeout_s``)."""
    (work / "workload.toml").write_text(workload.text, encoding="utf-8")
    source = workload.source or f"{workload.name}.toml"
    children: list[_Child] = []
    try:
        for device, cache_dir in cache_dirs.items():
            children.append(
                _Child(
                    device=device,
                    mode=mode,
                    cache_dir=cache_dir,
                    work=work,
                    source=source,
                    progress=progress,
                    omp_num_threads=workload.omp_num_threads,
                    confinement=confinement or Confinement(),
                )
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return [child.wait(deadline) for child in children]
    finally:
        for child in children:
            child.kill()
