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
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from cachekeeper import config
from cachekeeper.builder.allowlist import check_defined
from cachekeeper.builder.workload import Entrypoint, Regime, Workload, parse_workload
from cachekeeper.errors import WorkloadInvalid
from cachekeeper.fsutil import atomic_write_text
from cachekeeper.mods import build_mask_mod, build_score_mod, load_object

PROGRESS_PREFIX = "@@cachekeeper-progress "
FAKE_CUDA_ENV = config.TEST_FAKE_CUDA
COUNTER_KEYS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}
TRACEBACK_LINES = 20


class _SetupError(Exception):
    """The workload could not be set up (wraps a WorkloadInvalid)."""


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


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before.get(key, 0) for key in after}


class _Runner:
    def __init__(self, workload: Workload, device: str, mode: str, *, started: float) -> None:
        import torch

        self.workload = workload
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

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _emit(self, name: str, event: str, **extra: Any) -> None:
        _progress(
            device=self.device_name,
            mode=self.mode,
            regime=name,
            event=event,
            elapsed_s=round(time.monotonic() - self.started, 3),
            **extra,
        )

    def regime(self, index: int, regime: Regime) -> dict[str, Any]:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        name = f"attention[{index}]"
        try:
            mask_mod = build_mask_mod(regime.mask, regime.mask_args, field=f"{name}.mask")
            score_mod = build_score_mod(
                regime.score_mod,
                regime.score_args,
                heads=regime.q_heads,
                field=f"{name}.score_mod",
            )
        except WorkloadInvalid as exc:
            raise _SetupError(exc.detail) from exc
        dtype = getattr(torch, regime.dtype)
        # flex_attention has no CPU backward: backward = true is ignored there.
        backward = regime.backward and self.device.type != "cpu"
        compiled = torch.compile(flex_attention, **regime.compile)
        before = _counters()
        seq_seconds: list[float] = []
        for seq in regime.seq_lens:
            self.current = f"{name} (seq {seq})"
            self._emit(name, "start", label=regime.describe(seqs=False), seq=seq)
            step_before = _counters()
            t0 = time.monotonic()
            block_mask = None
            if mask_mod is not None:
                block_mask = create_block_mask(
                    mask_mod, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=self.device
                )
            shape = (regime.batch, regime.q_heads, seq, regime.head_dim)
            kv_shape = (regime.batch, regime.kv_heads, seq, regime.head_dim)
            q, k, v = (
                torch.randn(*s, device=self.device, dtype=dtype, requires_grad=backward)
                for s in (shape, kv_shape, kv_shape)
            )
            kwargs: dict[str, Any] = {
                "score_mod": score_mod,
                "block_mask": block_mask,
                "enable_gqa": regime.enable_gqa,
            }
            if regime.kernel_options is not None:
                kwargs["kernel_options"] = dict(regime.kernel_options)
            if backward:
                out = compiled(q, k, v, **kwargs)
                out.sum().backward()
            else:
                with torch.no_grad():
                    compiled(q, k, v, **kwargs)
            self._sync()
            seconds = time.monotonic() - t0
            seq_seconds.append(round(seconds, 3))
            self._emit(
                name,
                "done",
                label=regime.describe(seqs=False),
                seq=seq,
                seconds=round(seconds, 3),
                counters=_delta(_counters(), step_before),
            )
        return {
            "name": name,
            "label": regime.describe() + (" fwd+bwd" if backward else " fwd"),
            "seconds": round(sum(seq_seconds), 3),
            "seq_seconds": seq_seconds,
            "counters": _delta(_counters(), before),
        }

    def entrypoint(self, index: int, entry: Entrypoint) -> dict[str, Any]:
        name = f"entrypoint[{index}]"
        try:
            fn = load_object(entry.target, field=f"{name}.target")
        except WorkloadInvalid as exc:
            raise _SetupError(exc.detail) from exc
        kwargs = dict(entry.kwargs)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        if "device" in params and "device" not in kwargs:
            kwargs["device"] = str(self.device)
        self.current = name
        self._emit(name, "start", label=entry.target)
        before = _counters()
        t0 = time.monotonic()
        fn(**kwargs)
        self._sync()
        seconds = round(time.monotonic() - t0, 3)
        counters = _delta(_counters(), before)
        self._emit(name, "done", label=entry.target, seconds=seconds, counters=counters)
        return {
            "name": name,
            "label": entry.target,
            "seconds": seconds,
            "seq_seconds": [],
            "counters": counters,
        }


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
    """Run every regime, then every entrypoint, in order; never raises for workload errors."""
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
        runner = _Runner(workload, device, mode, started=started)
        steps: list[tuple[str, Any]] = [
            (f"attention[{i}]", lambda i=i, r=r: runner.regime(i, r))
            for i, r in enumerate(workload.regimes)
        ] + [
            (f"entrypoint[{i}]", lambda i=i, e=e: runner.entrypoint(i, e))
            for i, e in enumerate(workload.entrypoints)
        ]
        for where, step in steps:
            result["regimes"].append(step())
            where = "teardown"
    except _SetupError as exc:
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
                if ref.kind == "import":
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
