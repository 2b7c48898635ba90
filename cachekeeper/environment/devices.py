"""The one device grammar: ``cpu``, ``cuda`` (every visible GPU), ``cuda:0,1,...`` or
``cuda:0-7`` (ranges may mix with lists: ``cuda:0,5-7``).

Every command that takes ``--device`` (prewarm, verify, agent, pull, prejob) parses it here.
``parse_devices`` also checks the indices against the GPUs this process sees (prewarm and
verify must run on them); ``requested_devices`` only parses, for the hook, which sends the
list to the server and must not pay for a GPU query of its own. ``format_devices`` writes a
list back in that grammar (``cuda:0-7``).

This module is text only: it asks no GPU. The visible GPUs are the fingerprint's
(``fingerprint.visible_gpus``), which the caller hands in (``select_devices(spec,
visible=visible_gpus)``, asked only when the spec names ``cuda``), so the fingerprint can
word its device mismatches here and the two import each other one way.

The device index is part of Inductor's key: a cache built on ``cuda:0`` misses on ``cuda:1``,
so a snapshot serves only jobs whose ranks compile on indices it covers, and a builder with
fewer GPUs than the training nodes cannot build the higher indices. ``coverage_advice``
says so in one line, with what to do; every place that finds such a gap (verify, explain,
prejob, status, a builder asked for indices it lacks) uses it or says the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cachekeeper.errors import DeviceInvalid

__all__ = [
    "coverage_advice",
    "format_devices",
    "parse_devices",
    "requested_devices",
    "select_devices",
]

_GRAMMAR = "expected 'cpu', 'cuda', 'cuda:0,1,...' or 'cuda:0-7'"
_MAX_INDEX = 1023  # bounds "cuda:0-N", which the server parses too


def _indices(spec: str) -> list[int]:
    """The GPU indices of ``"cuda:0,1"`` or ``"cuda:0-7"`` (``cuda:`` may repeat:
    ``cuda:0,cuda:1``), in order, without repeats."""
    indices: list[int] = []
    for part in spec.removeprefix("cuda:").split(","):
        part = part.strip().removeprefix("cuda:")
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise DeviceInvalid(f"device {spec!r}: {part!r} is not a GPU index or range")
        end = int(last) if dash else int(first)
        if end > _MAX_INDEX:
            raise DeviceInvalid(f"device {spec!r}: {part!r} is past cuda:{_MAX_INDEX}")
        for index in range(int(first), end + 1):
            if index not in indices:
                indices.append(index)
    return indices


def format_devices(devices: object) -> str:
    """``["cuda:0", ..., "cuda:7"]`` -> ``"cuda:0-7"``; ``["cuda:1", "cuda:0"]`` -> ``"cuda:0,1"``.

    Runs of three or more indices become ranges; ``cpu`` (or anything that is not
    ``cuda:N``) is listed as it is; an empty list is ``"none"``.
    """
    items = [str(d) for d in devices or []] if isinstance(devices, list | tuple) else []
    cuda = sorted({int(d[5:]) for d in items if d.startswith("cuda:") and d[5:].isdigit()})
    others = sorted({d for d in items if not (d.startswith("cuda:") and d[5:].isdigit())})
    parts: list[str] = []
    start = 0
    while start < len(cuda):
        end = start
        while end + 1 < len(cuda) and cuda[end + 1] == cuda[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{cuda[start]}-{cuda[end]}")
        else:
            parts.extend(str(i) for i in cuda[start : end + 1])
        start = end + 1
    head = [f"cuda:{','.join(parts)}"] if parts else []
    return ", ".join(head + others) or "none"


def coverage_advice(*, covered: object, wanted: object, who: str = "this node") -> str:
    """Why a snapshot built on ``covered`` cannot serve a job on ``wanted``, and what to do.

    One line, e.g. ``snapshot covers cuda:0,1; this node asks for cuda:0-7: cuda:2-7 never
    built (the device index is in Inductor's key): build cuda:2-7 on a builder with >= 8
    GPUs (prewarm --device cuda:2-7), or run one visible GPU per rank (then only cuda:0 is
    needed)``.
    """
    have = {str(d) for d in covered or []} if isinstance(covered, list | tuple) else set()
    asked = [str(d) for d in wanted or []] if isinstance(wanted, list | tuple) else []
    missing = [d for d in asked if d not in have]
    line = (
        f"snapshot covers {format_devices(sorted(have))}; {who} asks for "
        f"{format_devices(asked)}: {format_devices(missing)} never built "
        "(the device index is in Inductor's key)"
    )
    indices = [int(d[5:]) for d in missing if d.startswith("cuda:") and d[5:].isdigit()]
    if not indices:
        return line
    needed = max(indices) + 1
    build = format_devices(missing)
    gpus = f"{needed} GPUs" if needed > 1 else "1 GPU"
    advice = f"build {build} on a builder with >= {gpus} (prewarm --device {build})"
    if "cuda:0" in have:
        advice += ", or run one visible GPU per rank (then only cuda:0 is needed)"
    return f"{line}: {advice}"


def requested_devices(spec: str | None) -> list[str] | None:
    """``--device`` as pull and prejob send it: ``None`` (no spec, or ``cuda``) means every
    visible GPU; ``"cpu"`` -> ``["cpu"]``; ``"cuda:0,1"`` -> ``["cuda:0", "cuda:1"]``."""
    if spec is None or spec.strip() == "cuda":
        return None
    spec = spec.strip()
    if spec == "cpu":
        return ["cpu"]
    if not spec.startswith("cuda:"):
        raise DeviceInvalid(f"device {spec!r}: {_GRAMMAR}")
    return [f"cuda:{i}" for i in _indices(spec)]


def parse_devices(spec: str, *, visible: Sequence[int]) -> list[str]:
    """``"cpu"`` -> ``["cpu"]``; ``"cuda"`` -> every visible GPU; ``"cuda:0,1"`` -> those.

    ``visible`` are the CUDA indices to accept (``fingerprint.visible_gpus()``; tests inject them).
    Indices that are not visible are refused together, with what to do instead: a machine
    with fewer GPUs cannot build the higher indices (the index is in Inductor's key).
    """
    spec = spec.strip()
    if spec == "cpu":
        return ["cpu"]
    if spec != "cuda" and not spec.startswith("cuda:"):
        raise DeviceInvalid(f"device {spec!r}: {_GRAMMAR}")
    gpus = list(visible)
    if spec == "cuda":
        if not gpus:
            raise DeviceInvalid("device 'cuda': no GPU is visible (use --device cpu)")
        return [f"cuda:{i}" for i in gpus]
    indices = _indices(spec)
    absent = [f"cuda:{i}" for i in indices if i not in gpus]
    if absent:
        shown = format_devices([f"cuda:{i}" for i in gpus])
        needed = max(i for i in indices if i not in gpus) + 1
        raise DeviceInvalid(
            f"device {format_devices(absent)} is not visible (visible: {shown}): this machine"
            f" cannot build {format_devices(absent)} (the device index is in Inductor's key);"
            f" build on one with >= {needed} GPUs, or train with one visible GPU per rank"
            " (then only cuda:0 is needed)"
        )
    return [f"cuda:{i}" for i in indices]


def select_devices(spec: str | None, *, visible: Callable[[], Sequence[int]]) -> list[str]:
    """``parse_devices(spec)``; with no spec, every visible GPU, or the CPU when there is none.

    ``visible`` asks for the visible CUDA indices (``fingerprint.visible_gpus``); it is
    called only when the answer needs them (not for ``cpu``)."""
    if spec is None:
        gpus = list(visible())
        return parse_devices("cuda", visible=gpus) if gpus else ["cpu"]
    if spec.strip() != "cuda" and not spec.strip().startswith("cuda:"):
        return parse_devices(spec, visible=())  # "cpu", or the grammar's error: no GPU asked
    return parse_devices(spec, visible=visible())
