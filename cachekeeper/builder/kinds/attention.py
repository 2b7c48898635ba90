"""``[[attention]]``: one flex_attention regime, compiled per sequence length in order.

    [[attention]]
    batch = 1
    q_heads = 32
    kv_heads = 8                  # default: q_heads; q_heads must be a multiple of it
    head_dim = 128
    seq_lens = [4096, 8192]
    dtype = "bfloat16"
    mask = "document_causal"      # a built-in (cachekeeper.mods) or "pkg.mod:factory"
    mask_args = { doc_len = 1024 }
    score_mod = "softcap"         # likewise
    score_args = { cap = 30.0 }
    backward = true               # ignored on the CPU: flex_attention has no CPU backward
    compile = { dynamic = false } # torch.compile options this format passes
    kernel_options = { BLOCK_M = 64 }

A device kind: each regime is a step of the child on every device, one
``torch.compile(flex_attention)`` call per sequence length, forward (and backward), with the
mask and score mods ``cachekeeper.mods`` builds (training must trace the same ones). A mask
or score factory named by import path is code a builder runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cachekeeper.builder.kinds.base import (
    CodeRef,
    DeviceKind,
    SetupError,
    StepContext,
    StepResult,
    Validator,
    is_import_path,
    type_name,
)
from cachekeeper.errors import WorkloadInvalid
from cachekeeper.mods import build_mask_mod, build_score_mod

__all__ = [
    "DTYPES",
    "KIND",
    "MASKS",
    "MIN_HEAD_DIM",
    "SCORE_MODS",
    "AttentionKind",
    "Regime",
]

DTYPES = ("float32", "float16", "bfloat16")
# Built-in mask_mods and score_mods: name -> (required args, optional args).
MASKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "none": ((), ()),
    "causal": ((), ()),
    "sliding_window": (("window",), ()),
    "document_causal": (("doc_len",), ()),
    "prefix_lm": (("prefix_len",), ()),
}
SCORE_MODS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "none": ((), ()),
    "softcap": (("cap",), ()),
    "alibi": ((), ("heads",)),
}
# flex_attention's Triton kernels refuse embedding dims below 16 (tl.dot's minimum);
# dims that are not powers of two are padded by Inductor (torch >= 2.6) and accepted.
MIN_HEAD_DIM = 16
# torch.compile keyword arguments a workload may set, with their TOML types.
_COMPILE_KEYS: dict[str, type | tuple[type, ...]] = {
    "dynamic": bool,
    "fullgraph": bool,
    "backend": str,
    "mode": str,
    "options": dict,
}
_KEYS = frozenset(
    {
        "batch",
        "q_heads",
        "kv_heads",
        "head_dim",
        "seq_lens",
        "dtype",
        "mask",
        "mask_args",
        "score_mod",
        "score_args",
        "backward",
        "compile",
        "kernel_options",
    }
)


@dataclass(frozen=True)
class Regime:
    """One ``[[attention]]`` table: a flex_attention call pattern, run per seq len in order."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    seq_lens: tuple[int, ...]
    dtype: str
    mask: str = "none"
    mask_args: dict[str, Any] = field(default_factory=dict)
    score_mod: str = "none"
    score_args: dict[str, Any] = field(default_factory=dict)
    backward: bool = True
    compile: dict[str, Any] = field(default_factory=dict)
    kernel_options: dict[str, Any] | None = None

    @property
    def enable_gqa(self) -> bool:
        return self.q_heads != self.kv_heads

    def describe(self, *, seqs: bool = True) -> str:
        """A one-line human label, e.g. ``causal b1 h32/8 d128 bfloat16 seq 4096,8192``."""
        mods = self.mask if self.score_mod == "none" else f"{self.mask}+{self.score_mod}"
        label = (
            f"{mods} b{self.batch} h{self.q_heads}/{self.kv_heads} d{self.head_dim} {self.dtype}"
        )
        if seqs:
            label += " seq " + ",".join(str(s) for s in self.seq_lens)
        return label

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch": self.batch,
            "q_heads": self.q_heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "seq_lens": list(self.seq_lens),
            "dtype": self.dtype,
            "mask": self.mask,
            "mask_args": dict(self.mask_args),
            "score_mod": self.score_mod,
            "score_args": dict(self.score_args),
            "backward": self.backward,
            "compile": dict(self.compile),
        }
        if self.kernel_options is not None:
            out["kernel_options"] = dict(self.kernel_options)
        return out


class AttentionKind(DeviceKind):
    """``[[attention]]`` tables (the module docstring)."""

    table = "attention"
    # Each sequence length of each regime is one flex_attention compile per device, cold
    # (seconds to a minute each), then again in verify; a real training run has a handful.
    limits = {
        "attention": 64,  # [[attention]] tables
        "seq_lens": 64,  # per regime
        "calls": 256,  # sequence lengths of all regimes together
    }

    def parse(self, v: Validator, raw: dict[str, Any], *, where: str) -> Regime:
        return _regime(v, raw, where)

    def check(self, v: Validator, specs: tuple[Regime, ...]) -> None:
        v.at_most(
            "attention",
            sum(len(r.seq_lens) for r in specs),
            self.limits["calls"],
            "sequence lengths in all regimes (each is a cold compile per device)",
            per=" in a workload",
        )

    def code(self, spec: Regime, *, where: str) -> tuple[CodeRef, ...]:
        return tuple(
            CodeRef("import", value, f"{where}.{fld}")
            for fld, value in (("mask", spec.mask), ("score_mod", spec.score_mod))
            if ":" in value
        )

    def describe(self, spec: Regime) -> str:
        return spec.describe()

    def run_step(self, spec: Regime, *, name: str, child: StepContext) -> StepResult:
        import torch  # only in the prewarm or verify child
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        try:
            mask_mod = build_mask_mod(spec.mask, spec.mask_args, field=f"{name}.mask")
            score_mod = build_score_mod(
                spec.score_mod, spec.score_args, heads=spec.q_heads, field=f"{name}.score_mod"
            )
        except WorkloadInvalid as exc:
            raise SetupError(exc.detail) from exc
        device = child.device
        dtype = getattr(torch, spec.dtype)
        # flex_attention has no CPU backward: backward = true is ignored there.
        backward = spec.backward and device.type != "cpu"
        compiled = torch.compile(flex_attention, **spec.compile)
        label = spec.describe(seqs=False)
        before = child.counters()
        seq_seconds: list[float] = []
        for seq in spec.seq_lens:
            child.at(f"{name} (seq {seq})")
            child.emit(name, "start", label=label, seq=seq)
            step_before = child.counters()
            t0 = time.monotonic()
            block_mask = None
            if mask_mod is not None:
                block_mask = create_block_mask(
                    mask_mod, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device
                )
            shape = (spec.batch, spec.q_heads, seq, spec.head_dim)
            kv_shape = (spec.batch, spec.kv_heads, seq, spec.head_dim)
            q, k, v = (
                torch.randn(*s, device=device, dtype=dtype, requires_grad=backward)
                for s in (shape, kv_shape, kv_shape)
            )
            kwargs: dict[str, Any] = {
                "score_mod": score_mod,
                "block_mask": block_mask,
                "enable_gqa": spec.enable_gqa,
            }
            if spec.kernel_options is not None:
                kwargs["kernel_options"] = dict(spec.kernel_options)
            if backward:
                out = compiled(q, k, v, **kwargs)
                out.sum().backward()
            else:
                with torch.no_grad():
                    compiled(q, k, v, **kwargs)
            child.sync()
            seconds = time.monotonic() - t0
            seq_seconds.append(round(seconds, 3))
            child.emit(
                name,
                "done",
                label=label,
                seq=seq,
                seconds=round(seconds, 3),
                counters=_delta(child.counters(), step_before),
            )
        return {
            "name": name,
            "label": spec.describe() + (" fwd+bwd" if backward else " fwd"),
            "seconds": round(sum(seq_seconds), 3),
            "seq_seconds": seq_seconds,
            "counters": _delta(child.counters(), before),
        }


KIND = AttentionKind()


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before.get(key, 0) for key in after}


def _regime(v: Validator, table: dict[str, Any], where: str) -> Regime:
    v.unknown_keys(table, _KEYS, where)
    batch = v.positive(table, "batch", where)
    q_heads = v.positive(table, "q_heads", where)
    kv_heads = v.positive(table, "kv_heads", where) if "kv_heads" in table else q_heads
    if q_heads % kv_heads:
        v.fail(
            f"{where}.kv_heads",
            f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})",
        )
    head_dim = v.positive(table, "head_dim", where)
    if head_dim < MIN_HEAD_DIM:
        v.fail(
            f"{where}.head_dim",
            f"flex_attention needs head_dim >= {MIN_HEAD_DIM}, got {head_dim}",
        )
    seq_lens = v.required(table, "seq_lens", list, where)
    if not seq_lens:
        v.fail(f"{where}.seq_lens", "must list at least one sequence length")
    v.at_most(
        f"{where}.seq_lens",
        len(seq_lens),
        AttentionKind.limits["seq_lens"],
        "sequence lengths (each is a cold compile per device)",
        per=" per regime",
    )
    for i, seq in enumerate(seq_lens):
        v.typed(seq, int, f"{where}.seq_lens[{i}]")
        if seq <= 0:
            v.fail(f"{where}.seq_lens[{i}]", f"must be a positive integer, got {seq}")
    dtype = v.required(table, "dtype", str, where)
    if dtype not in DTYPES:
        v.fail(f"{where}.dtype", f"unknown dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
    mask = v.typed(table.get("mask", "none"), str, f"{where}.mask")
    mask_args = _mod_args(v, table, where, "mask", mask, MASKS)
    score_mod = v.typed(table.get("score_mod", "none"), str, f"{where}.score_mod")
    score_args = _mod_args(v, table, where, "score", score_mod, SCORE_MODS, field="score_mod")
    backward = v.typed(table.get("backward", True), bool, f"{where}.backward")
    compile_kwargs = v.typed(table.get("compile", {}), dict, f"{where}.compile")
    for key, value in compile_kwargs.items():
        kind = _COMPILE_KEYS.get(key)
        if kind is None:
            v.fail(
                f"{where}.compile.{key}",
                f"not a torch.compile option this format passes (allowed: "
                f"{', '.join(sorted(_COMPILE_KEYS))})",
            )
        v.typed(value, kind, f"{where}.compile.{key}")  # type: ignore[arg-type]
    kernel_options = table.get("kernel_options")
    if kernel_options is not None:
        v.typed(kernel_options, dict, f"{where}.kernel_options")
        for key, value in kernel_options.items():
            if not isinstance(value, bool | int | float | str):
                v.fail(
                    f"{where}.kernel_options.{key}",
                    f"expected a number, boolean or string, got {type_name(type(value))}",
                )
    return Regime(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        seq_lens=tuple(seq_lens),
        dtype=dtype,
        mask=mask,
        mask_args=mask_args,
        score_mod=score_mod,
        score_args=score_args,
        backward=backward,
        compile=dict(compile_kwargs),
        kernel_options=dict(kernel_options) if kernel_options is not None else None,
    )


def _mod_args(
    v: Validator,
    table: dict[str, Any],
    where: str,
    prefix: str,
    name: str,
    builtins: dict[str, tuple[tuple[str, ...], tuple[str, ...]]],
    *,
    field: str | None = None,
) -> dict[str, Any]:
    field = field or prefix
    args_key = f"{prefix}_args"
    args = v.typed(table.get(args_key, {}), dict, f"{where}.{args_key}")
    if ":" in name:
        if not is_import_path(name):
            v.fail(f"{where}.{field}", f"{name!r} is not an import path of the form 'pkg.mod:attr'")
        return dict(args)  # a factory's arguments are the factory's business
    if name not in builtins:
        v.fail(
            f"{where}.{field}",
            f"unknown {field} {name!r} (built-in: {', '.join(builtins)}; or 'pkg.mod:factory')",
        )
    required, optional = builtins[name]
    for key in args:
        if key not in required and key not in optional:
            allowed = ", ".join(required + optional) or "none"
            v.fail(
                f"{where}.{args_key}.{key}", f"unknown argument for {name!r} (allowed: {allowed})"
            )
    for key in required:
        if key not in args:
            v.fail(f"{where}.{args_key}.{key}", f"{name!r} requires this argument")
    for key, value in args.items():
        arg_where = f"{where}.{args_key}.{key}"
        if key == "cap":
            if v.typed(value, float, arg_where) <= 0:
                v.fail(arg_where, f"must be positive, got {value}")
        elif key == "prefix_len":
            if v.typed(value, int, arg_where) < 0:
                v.fail(arg_where, f"must be >= 0, got {value}")
        elif v.typed(value, int, arg_where) <= 0:
            v.fail(arg_where, f"must be a positive integer, got {value}")
    return {key: float(val) if key == "cap" else val for key, val in args.items()}
