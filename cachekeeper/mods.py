"""Built-in flex_attention mask_mods and score_mods, and import-path factories.

A prewarm only helps when it traces the same mask/score code as training: the traced
graph is part of Inductor's cache key. Training code that wants its cache prewarmed by a
workload naming ``mask = "document_causal"`` should build its mask with
``cachekeeper.mods.document_causal(doc_len)`` itself, or point the workload at its own
factory (``mask = "mytrainer.masks:make_mask"``).

Every factory returns a plain function of ``(b, h, q_idx, kv_idx)`` (mask_mod) or
``(score, b, h, q_idx, kv_idx)`` (score_mod). ``none`` returns ``None``: the regime then
passes no block mask / no score_mod, as training code without one does. torch is imported
inside the factories that need it, never at module level.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from cachekeeper.errors import WorkloadInvalid

__all__ = [
    "causal",
    "sliding_window",
    "document_causal",
    "prefix_lm",
    "softcap",
    "alibi",
    "MASK_FACTORIES",
    "SCORE_FACTORIES",
    "load_object",
    "build_mask_mod",
    "build_score_mod",
]

MaskMod = Callable[[Any, Any, Any, Any], Any]
ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]


def causal() -> MaskMod:
    """Each query attends to itself and earlier positions."""

    def causal_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    return causal_mask


def sliding_window(window: int) -> MaskMod:
    """Causal, limited to the ``window`` most recent positions (the query's own included)."""

    def sliding_window_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return sliding_window_mask


def document_causal(doc_len: int) -> MaskMod:
    """Causal within fixed-length packed documents of ``doc_len`` tokens."""

    def document_causal_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx // doc_len == kv_idx // doc_len) & (q_idx >= kv_idx)

    return document_causal_mask


def prefix_lm(prefix_len: int) -> MaskMod:
    """Bidirectional over the first ``prefix_len`` positions, causal after them."""

    def prefix_lm_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)

    return prefix_lm_mask


def softcap(cap: float) -> ScoreMod:
    """Soft-cap the logits: ``cap * tanh(score / cap)`` (Gemma 2 style)."""
    import torch

    def softcap_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * torch.tanh(score / cap)

    return softcap_score


def alibi(heads: int) -> ScoreMod:
    """ALiBi: add ``slope(h) * (kv_idx - q_idx)``, slope(h) = 2 ** (-8 (h + 1) / heads).

    In a workload ``heads`` defaults to the regime's ``q_heads``.
    """
    import torch

    def alibi_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # Explicit float casts: mixing int index tensors and floats in one expression
        # fails Inductor's C++ codegen on CPU (torch 2.13).
        slope = torch.exp2((h + 1).to(torch.float32) * (-8.0 / heads))
        return score + slope * (kv_idx - q_idx).to(torch.float32)

    return alibi_score


def _none() -> None:
    return None


MASK_FACTORIES: dict[str, Callable[..., MaskMod | None]] = {
    "none": _none,
    "causal": causal,
    "sliding_window": sliding_window,
    "document_causal": document_causal,
    "prefix_lm": prefix_lm,
}
SCORE_FACTORIES: dict[str, Callable[..., ScoreMod | None]] = {
    "none": _none,
    "softcap": softcap,
    "alibi": alibi,
}


def load_object(path: str, *, field: str) -> Any:
    """Import ``"pkg.mod:attr"``; a failure is a WorkloadInvalid naming ``field``."""
    module_name, _, attr_path = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise WorkloadInvalid(
            f"{field}: cannot import module {module_name!r} of {path!r}: {exc}"
        ) from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as exc:
            raise WorkloadInvalid(f"{field}: {path!r}: no attribute {attr!r}") from exc
    if not callable(obj):
        raise WorkloadInvalid(f"{field}: {path!r} is not callable")
    return obj


def _build(
    name: str,
    args: dict[str, Any],
    factories: dict[str, Callable[..., Any]],
    *,
    field: str,
) -> Any:
    factory = factories.get(name) or load_object(name, field=field)
    try:
        return factory(**args)
    except TypeError as exc:
        raise WorkloadInvalid(f"{field}: calling {name!r} with {args!r} failed: {exc}") from exc


def build_mask_mod(name: str, args: dict[str, Any], *, field: str) -> MaskMod | None:
    """The mask_mod for a regime's ``mask`` / ``mask_args`` (None for ``"none"``)."""
    result: MaskMod | None = _build(name, args, MASK_FACTORIES, field=field)
    return result


def build_score_mod(name: str, args: dict[str, Any], *, heads: int, field: str) -> ScoreMod | None:
    """The score_mod for a regime's ``score_mod`` / ``score_args`` (None for ``"none"``)."""
    if name == "alibi":
        args = {"heads": heads, **args}
    result: ScoreMod | None = _build(name, args, SCORE_FACTORIES, field=field)
    return result
