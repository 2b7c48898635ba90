"""Prewarm and verify: compile a workload per device in fresh processes, prove the cache.

``prewarm(workload, cache_dir, devices=[...])``:

1. For each device, one fresh child process (``python -m cachekeeper._child``) with an
   empty staging ``TORCHINDUCTOR_CACHE_DIR`` compiles every regime in order, then every
   entrypoint. GPUs run in parallel, one process each, on their real index (all GPUs stay
   visible: the device index is part of Inductor's key). The CPU is one process.
2. If any child's workload raised, the cold compile is broken: the report says
   ``cold_compile_broken`` with the exception and its last traceback lines, and nothing
   is merged. Any other child failure (crash, timeout, an import path that does not
   resolve) is ``failed``; nothing is merged either.
3. Otherwise every staging dir is merged into ``cache_dir`` with the restore rules
   (``cachekeeper.restore.merge_tree``: never delete, verified, atomic).
4. Then ``verify``: a fresh child per device against ``cache_dir``, judged by
   ``cachekeeper.verify.is_effective``.

The work area is a temp folder next to ``cache_dir`` (same filesystem), removed when done::

    <cache_dir parent>/.cachekeeper-prewarm-XXXX/
      workload.toml               # the workload text the children read
      staging-cuda_0/             # cuda:0's empty-at-start TORCHINDUCTOR_CACHE_DIR
      result-cuda_0.json          # cuda:0's result (see cachekeeper._child)
      stdout-cuda_0.log           # what the workload printed

Children get ``TRITON_CACHE_DIR`` removed from their environment so that Triton's cache
lands in ``<cache dir>/triton/<index>`` and is part of what is merged and snapshotted.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachekeeper._child import PROGRESS_PREFIX
from cachekeeper.errors import CachekeeperError, PrewarmFailed
from cachekeeper.verify import (
    DeviceRun,
    ErrorInfo,
    PrewarmReport,
    ProgressEvent,
    VerifyReport,
)
from cachekeeper.workload import Workload

__all__ = ["prewarm", "verify", "parse_devices", "select_devices", "visible_gpus", "Progress"]

Progress = Callable[[ProgressEvent], None]
_STDERR_TAIL = 40


def visible_gpus() -> list[int]:
    """The CUDA indices this process can see, from the fingerprint (no torch import)."""
    from cachekeeper.fingerprint import collect

    return [int(gpu["index"]) for gpu in collect().get("gpus") or []]


def parse_devices(spec: str, *, visible: list[int] | None = None) -> list[str]:
    """``"cpu"`` -> ``["cpu"]``; ``"cuda"`` -> every visible GPU; ``"cuda:0,1"`` -> those.

    ``visible`` (the CUDA indices to accept) defaults to ``visible_gpus()``; tests inject it.
    """
    spec = spec.strip()
    if spec == "cpu":
        return ["cpu"]
    if spec != "cuda" and not spec.startswith("cuda:"):
        raise PrewarmFailed(f"device {spec!r}: expected 'cpu', 'cuda' or 'cuda:0,1,...'")
    gpus = visible_gpus() if visible is None else list(visible)
    if spec == "cuda":
        if not gpus:
            raise PrewarmFailed("device 'cuda': no GPU is visible (use --device cpu)")
        return [f"cuda:{i}" for i in gpus]
    indices: list[int] = []
    for part in spec.removeprefix("cuda:").split(","):
        part = part.strip().removeprefix("cuda:")
        if not part.isdigit():
            raise PrewarmFailed(f"device {spec!r}: {part!r} is not a GPU index")
        index = int(part)
        if index not in gpus:
            shown = ",".join(str(i) for i in gpus) or "none"
            raise PrewarmFailed(f"device cuda:{index} is not visible (visible: {shown})")
        if index not in indices:
            indices.append(index)
    return [f"cuda:{i}" for i in indices]


def select_devices(spec: str | None) -> list[str]:
    """``parse_devices(spec)``; with no spec, every visible GPU, or the CPU when there is none."""
    if spec is None:
        gpus = visible_gpus()
        return parse_devices("cuda", visible=gpus) if gpus else ["cpu"]
    return parse_devices(spec)


def prewarm(
    workload: Workload,
    cache_dir: Path,
    *,
    devices: list[str],
    progress: Progress | None = None,
    timeout_s: float | None = None,
) -> PrewarmReport:
    """Cold-compile ``workload`` on each device, merge into ``cache_dir``, then verify.

    Never raises for what the workload does (see ``PrewarmReport.status``); raises
    PrewarmFailed when the work area cannot be created. ``timeout_s`` bounds each child.
    """
    cache_dir = Path(cache_dir).absolute()
    started = time.monotonic()
    with _work_area(cache_dir) as work:
        staging = {device: work / f"staging-{_slug(device)}" for device in devices}
        for path in staging.values():
            path.mkdir()
        runs = _run_children(
            workload,
            {d: staging[d] for d in devices},
            mode="prewarm",
            work=work,
            progress=progress,
            timeout_s=timeout_s,
        )
        if any(run.status != "ok" for run in runs):
            return PrewarmReport(
                workload=workload.name,
                workload_digest=workload.digest,
                cache_dir=str(cache_dir),
                devices=tuple(runs),
                seconds=round(time.monotonic() - started, 3),
            )
        merged: dict[str, dict[str, Any]] = {}
        try:
            from cachekeeper.restore import merge_tree

            cache_dir.mkdir(parents=True, exist_ok=True)
            for device in devices:
                merged[device] = merge_tree(staging[device], cache_dir).to_dict()
                merged[device].pop("planned", None)
        except CachekeeperError as exc:
            return PrewarmReport(
                workload=workload.name,
                workload_digest=workload.digest,
                cache_dir=str(cache_dir),
                devices=tuple(runs),
                seconds=round(time.monotonic() - started, 3),
                merged=merged,
                error=ErrorInfo(type=type(exc).__name__, message=exc.detail, where="merge"),
            )
    verify_report = verify(
        workload, cache_dir, devices=devices, timeout_s=timeout_s, progress=progress
    )
    report = PrewarmReport(
        workload=workload.name,
        workload_digest=workload.digest,
        cache_dir=str(cache_dir),
        devices=tuple(runs),
        seconds=round(time.monotonic() - started, 3),
        merged=merged,
        verify=verify_report,
    )
    from cachekeeper.provenance import record_prewarm

    record_prewarm(
        cache_dir,
        workload=workload.name,
        workload_digest=workload.digest,
        devices=list(devices),
        stats=report.stats,
    )
    return report


def verify(
    workload: Workload,
    cache_dir: Path,
    *,
    devices: list[str],
    timeout_s: float | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Run ``workload`` against ``cache_dir`` in a fresh process per device; judge counters.

    What a run that misses compiles is written into ``cache_dir`` by Inductor itself (it
    only adds entries); the verdict comes from the counters of this run.
    """
    cache_dir = Path(cache_dir).absolute()
    if not cache_dir.is_dir():
        raise PrewarmFailed(f"cache dir {cache_dir} does not exist or is not a directory")
    started = time.monotonic()
    with _work_area(cache_dir) as work:
        runs = _run_children(
            workload,
            {device: cache_dir for device in devices},
            mode="verify",
            work=work,
            progress=progress,
            timeout_s=timeout_s,
        )
    return VerifyReport(
        workload=workload.name,
        workload_digest=workload.digest,
        cache_dir=str(cache_dir),
        devices=tuple(runs),
        seconds=round(time.monotonic() - started, 3),
    )


# -- child processes ---------------------------------------------------------------------


class _work_area:
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


def _slug(device: str) -> str:
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
    ) -> None:
        self.device = device
        self.mode = mode
        self.result_path = work / f"result-{mode}-{_slug(device)}.json"
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL)
        self.progress = progress
        env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        command = [
            sys.executable, "-m", "cachekeeper._child",
            "--workload", str(work / "workload.toml"), "--source", source,
            "--device", device, "--mode", mode, "--result", str(self.result_path),
        ]  # fmt: skip
        self.started = time.monotonic()
        with open(work / f"stdout-{mode}-{_slug(device)}.log", "wb") as stdout:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.PIPE,
                start_new_session=True,  # so a timeout can kill the whole process group
            )
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
        """Kill the child's whole process group (compile workers included), if any is left."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

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
        try:
            raw = json.loads(self.result_path.read_text("utf-8"))
            return DeviceRun.from_result(raw, seconds=seconds)
        except (OSError, ValueError, KeyError, TypeError):
            message = f"exited with status {self.proc.returncode} without a result"
            return self._failed("crashed", ErrorInfo("ChildCrashed", message, "", tail), seconds)

    def _failed(self, status: Any, error: ErrorInfo, seconds: float) -> DeviceRun:
        return DeviceRun(
            device=self.device,
            mode=self.mode,
            status=status,
            seconds=round(seconds, 3),
            error=error,
        )


def _run_children(
    workload: Workload,
    cache_dirs: dict[str, Path],
    *,
    mode: str,
    work: Path,
    progress: Progress | None,
    timeout_s: float | None,
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
                )
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return [child.wait(deadline) for child in children]
    finally:
        for child in children:
            child.kill()
