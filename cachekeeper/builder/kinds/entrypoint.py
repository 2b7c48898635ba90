"""``[[entrypoint]]``: the training code's own warm-up step, called with keyword arguments.

    [[entrypoint]]
    target = "mytrainer.warmup:step"   # an import path: code a builder runs
    kwargs = { seq_len = 4096 }

A device kind: the child on each device imports ``target`` and calls it with ``kwargs``
(and ``device="cuda:N"`` when it takes a ``device`` argument the workload does not set),
after every ``[[attention]]`` regime.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

from cachekeeper import wire
from cachekeeper.builder.kinds.base import (
    CodeRef,
    DeviceKind,
    SetupError,
    StepContext,
    StepResult,
    Validator,
    is_import_path,
)
from cachekeeper.errors import WorkloadInvalid
from cachekeeper.mods import load_object

__all__ = ["KIND", "Entrypoint", "EntrypointKind"]

_KEYS = frozenset({"target", "kwargs"})


@dataclass(frozen=True)
class Entrypoint:
    """One ``[[entrypoint]]`` table: the training code's own warm-up, called with kwargs."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return wire.to_dict(self)


class EntrypointKind(DeviceKind):
    """``[[entrypoint]]`` tables (the module docstring)."""

    table = "entrypoint"
    limits = {"entrypoint": 64}  # [[entrypoint]] tables

    def parse(self, v: Validator, raw: dict[str, Any], *, where: str) -> Entrypoint:
        v.unknown_keys(raw, _KEYS, where)
        target = v.required(raw, "target", str, where)
        if not is_import_path(target):
            v.fail(
                f"{where}.target", f"{target!r} is not an import path of the form 'pkg.mod:attr'"
            )
        kwargs = v.typed(raw.get("kwargs", {}), dict, f"{where}.kwargs")
        return Entrypoint(target=target, kwargs=dict(kwargs))

    def code(self, spec: Entrypoint, *, where: str) -> tuple[CodeRef, ...]:
        return (CodeRef("import", spec.target, f"{where}.target"),)

    def describe(self, spec: Entrypoint) -> str:
        return spec.target

    def run_step(self, spec: Entrypoint, *, name: str, child: StepContext) -> StepResult:
        try:
            fn = load_object(spec.target, field=f"{name}.target")
        except WorkloadInvalid as exc:
            raise SetupError(exc.detail) from exc
        kwargs = dict(spec.kwargs)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        if "device" in params and "device" not in kwargs:
            kwargs["device"] = str(child.device)
        child.at(name)
        child.emit(name, "start", label=spec.target)
        before = child.counters()
        t0 = time.monotonic()
        fn(**kwargs)
        child.sync()
        seconds = round(time.monotonic() - t0, 3)
        after = child.counters()
        counters = {key: after[key] - before.get(key, 0) for key in after}
        child.emit(name, "done", label=spec.target, seconds=seconds, counters=counters)
        return {
            "name": name,
            "label": spec.target,
            "seconds": seconds,
            "seq_seconds": [],
            "counters": counters,
        }


KIND = EntrypointKind()
