"""The fresh process a prewarm or verify runs a workload in, on one device.

    TORCHINDUCTOR_CACHE_DIR=DIR python -m cachekeeper.builder._child \
        --workload FILE --source NAME --device cuda:3 --mode prewarm --result OUT.json

The cache dir must be in the environment before torch is imported (Inductor reads it
once), which is why this is a separate process and not a fork. All GPUs stay visible and
the workload runs on the real index (``cuda:3``): the device index is part of Inductor's
key. Progress goes to stderr as ``@@cachekeeper-progress {json}`` lines that the parent
relays; the result is one JSON object written to ``--result``:

    {"device", "mode", "status": "ok" | "error" | "invalid", "seconds",
     "regimes": [{"name", "label", "seconds", "seq_seconds", "counters"}],
     "counters": {...}, "error": {"type", "message", "where", "traceback_tail"} | null}

``status = "error"`` means the workload itself raised while compiling or running (a cold
compile that is broken); ``"invalid"`` means the workload could not be set up (an import
path that does not resolve, a factory that refuses its arguments).

``CACHEKEEPER_TEST_FAKE_CUDA=1`` (for cachekeeper's own test suite only, never for users)
runs a ``cuda:N`` device on the CPU so that the multi-GPU code path can be tested on a
machine without GPUs. Such a cache is a CPU cache and is useless on a GPU. To keep what
matters about GPU indices, fake ``cuda:N`` puts N into Inductor's key as a real GPU index
is: it sets ``torch._inductor.config.kernel_name_max_ops`` (an option in the FX graph key
that no code generation reads), so a cache built on fake ``cuda:0`` misses on ``cuda:1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, cast

from cachekeeper import config
from cachekeeper.builder.allowlist import check_defined
from cachekeeper.builder.kinds.base import DeviceKind, SetupError
from cachekeeper.builder.workload import Workload, parse_workload
from cachekeeper.errors import WorkloadInvalid
from cachekeeper.fsutil import atomic_write_text

PROGRESS_PREFIX = "@@cachekeeper-progress "
FAKE_CUDA_ENV = config.TEST_FAKE_CUDA
COUNTER_KEYS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}
TRACEBACK_LINES = 20


def _progress(**event: Any) -> None:
    sys.stderr.write(PROGRESS_PREFIX + json.dumps(event) + "\n")
    sys.stderr.flush()


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        key: int(counters[group].get(key, 0))
        for group, keys in COUNTER_KEYS.items()
        for key in keys
    }


class _Runner:
    """What a device kind's step runs with (``kinds.base.StepContext``): the device, the
    progress lines, the counters, and what a failure is reported in."""

    def __init__(self, device: str, mode: str, *, started: float) -> None:
        import torch

        self.device_name = device
        self.mode = mode
        fake = os.environ.get(FAKE_CUDA_ENV) == "1" and device.startswith("cuda")
        self.device = torch.device("cpu" if fake else device)
        if fake:
            import torch._inductor.config as inductor_config  # torch only in the child

            # The index in the key, as on a GPU (see the module docstring).
            inductor_config.kernel_name_max_ops = 10 + (torch.device(device).index or 0)
        if self.device.type == "cuda":
            # Entrypoints that say "cuda" run on this index too.
            torch.cuda.set_device(self.device)
        self.started = started  # the child's start: elapsed times include importing torch
        self.current = "setup"

    def at(self, where: str) -> None:
        self.current = where

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def counters(self) -> dict[str, int]:
        return _counters()

    def emit(self, name: str, event: str, **extra: Any) -> None:
        _progress(
            device=self.device_name,
            mode=self.mode,
            regime=name,
            event=event,
            elapsed_s=round(time.monotonic() - self.started, 3),
            **extra,
        )


def _error(exc: BaseException, where: str) -> dict[str, Any]:
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return {
        "type": type(exc).__name__,
        "message": str(exc).strip().splitlines()[0] if str(exc).strip() else "",
        "where": where,
        "traceback_tail": lines[-TRACEBACK_LINES:],
    }


def run(
    workload: Workload,
    *,
    device: str,
    mode: str,
    source: str = "workload",
    started: float | None = None,
) -> dict[str, Any]:
    """Run the tables of the device kinds in order (every regime, then every entrypoint);
    never raises for workload errors."""
    started = time.monotonic() if started is None else started
    result: dict[str, Any] = {
        "device": device,
        "mode": mode,
        "status": "ok",
        "regimes": [],
        "counters": {},
        "error": None,
    }
    where = "setup"
    runner: _Runner | None = None
    try:
        runner = _Runner(device, mode, started=started)
        for table in workload.device_tables:
            where = table.name
            kind = cast(DeviceKind, table.kind)
            result["regimes"].append(kind.run_step(table.spec, name=table.name, child=runner))
            where = "teardown"
    except SetupError as exc:
        result["status"] = "invalid"
        result["error"] = {
            "type": "WorkloadInvalid",
            "message": f"{source}: {exc}",
            "where": where,
            "traceback_tail": [],
        }
    except Exception as exc:  # the workload itself failed: report it, do not crash
        result["status"] = "error"
        result["error"] = _error(exc, runner.current if runner is not None else where)
    try:
        import torch

        result["torch"] = torch.__version__
        result["counters"] = _counters()
    except Exception:  # pragma: no cover - torch missing entirely
        pass
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(prog="python -m cachekeeper.builder._child")
    parser.add_argument("--workload", required=True, type=Path)
    parser.add_argument("--source", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--mode", required=True, choices=["prewarm", "verify"])
    parser.add_argument("--result", required=True, type=Path)
    parser.add_argument(
        "--defined-imports",
        action="store_true",
        help="refuse an import path unless its module defines it (the agent's allowlist rule)",
    )
    args = parser.parse_args(argv)
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        print("TORCHINDUCTOR_CACHE_DIR must be set before this process starts", file=sys.stderr)
        return 2
    try:
        workload = parse_workload(args.workload.read_text("utf-8"), source=args.source)
        if args.defined_imports:  # before anything of the workload is imported
            for ref in workload.code:
                if ref.form == "import":
                    check_defined(ref.value, field=f"{args.source}: {ref.where}")
    except WorkloadInvalid as exc:
        result: dict[str, Any] = {
            "device": args.device,
            "mode": args.mode,
            "status": "invalid",
            "regimes": [],
            "counters": {},
            "error": {"type": "WorkloadInvalid", "message": exc.detail, "where": "setup"},
        }
    else:
        result = run(
            workload, device=args.device, mode=args.mode, source=args.source, started=started
        )
    atomic_write_text(args.result, json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
