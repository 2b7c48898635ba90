"""The one device grammar: ``cpu``, ``cuda`` (every visible GPU) or ``cuda:0,1,...``.

Every command that takes ``--device`` (prewarm, verify, agent, pull, prejob) parses it here.
``parse_devices`` also checks the indices against the GPUs this process sees (prewarm and
verify must run on them); ``requested_devices`` only parses, for the hook, which sends the
list to the server and must not pay for a GPU query of its own.
"""

from __future__ import annotations

from cachekeeper.errors import PrewarmFailed

__all__ = ["parse_devices", "requested_devices", "select_devices", "visible_gpus"]

_GRAMMAR = "expected 'cpu', 'cuda' or 'cuda:0,1,...'"


def _indices(spec: str) -> list[int]:
    """The GPU indices of ``"cuda:0,1"`` (``cuda:`` may repeat: ``cuda:0,cuda:1``), in order."""
    indices: list[int] = []
    for part in spec.removeprefix("cuda:").split(","):
        part = part.strip().removeprefix("cuda:")
        if not part.isdigit():
            raise PrewarmFailed(f"device {spec!r}: {part!r} is not a GPU index")
        if int(part) not in indices:
            indices.append(int(part))
    return indices


def requested_devices(spec: str | None) -> list[str] | None:
    """``--device`` as pull and prejob send it: ``None`` (no spec, or ``cuda``) means every
    visible GPU; ``"cpu"`` -> ``["cpu"]``; ``"cuda:0,1"`` -> ``["cuda:0", "cuda:1"]``."""
    if spec is None or spec.strip() == "cuda":
        return None
    spec = spec.strip()
    if spec == "cpu":
        return ["cpu"]
    if not spec.startswith("cuda:"):
        raise PrewarmFailed(f"device {spec!r}: {_GRAMMAR}")
    return [f"cuda:{i}" for i in _indices(spec)]


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
        raise PrewarmFailed(f"device {spec!r}: {_GRAMMAR}")
    gpus = visible_gpus() if visible is None else list(visible)
    if spec == "cuda":
        if not gpus:
            raise PrewarmFailed("device 'cuda': no GPU is visible (use --device cpu)")
        return [f"cuda:{i}" for i in gpus]
    indices = _indices(spec)
    for index in indices:
        if index not in gpus:
            shown = ",".join(str(i) for i in gpus) or "none"
            raise PrewarmFailed(f"device cuda:{index} is not visible (visible: {shown})")
    return [f"cuda:{i}" for i in indices]


def select_devices(spec: str | None) -> list[str]:
    """``parse_devices(spec)``; with no spec, every visible GPU, or the CPU when there is none."""
    if spec is None:
        gpus = visible_gpus()
        return parse_devices("cuda", visible=gpus) if gpus else ["cpu"]
    return parse_devices(spec)
