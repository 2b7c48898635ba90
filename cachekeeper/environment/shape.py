"""The fingerprint's shape: the ``Fingerprint`` JSON object (with ``Gpu`` and ``CpuState``
inside) and ``parse``, its check. Nothing else.

It is its own module so that the fingerprint's parts can name it one way: ``cpu`` (the
``cpu`` field), ``remote_tier`` (which adds its key switches to a fingerprint) and
``fingerprint`` (which collects and compares) import it, and it imports none of them.
``cachekeeper.environment.fingerprint`` re-exports every name here: users import them from there.

The shape (``Fingerprint``, with ``Gpu`` and ``CpuState`` inside) is a TypedDict, not a
frozen dataclass, because a fingerprint *is* its JSON: its digest is the sha256 of its
canonical JSON (``fingerprint.digest_of``), and manifests, request bodies and the server's rows carry
it as JSON. A TypedDict types that JSON for mypy and leaves it as it is, so

- ``parse`` (a fingerprint from a manifest or the wire) checks the fields this version
  knows and returns the very object it was given: its canonical JSON and digest cannot
  move (tests/environment/test_fingerprint_digests.py pins them);
- a field this version does not know (a newer cachekeeper's, at any depth) is kept, so it
  stays in the digest, and a newer schema still parses;
- an absent field stays absent and a ``null`` stays ``null`` (their digests differ):
  every field may be absent (``total=False``: schema 1 has no ``cpu``, and a field a
  fingerprint lacks compares as null, as it always did).

A frozen dataclass would have to keep all three apart (unknown fields at every level,
absent or null per field) to write the same JSON back, and be converted at every
manifest, body and row, the hook's included. Every key is ``ReadOnly`` (for mypy): a
fingerprint is never changed in place; a variant is a new one (``fingerprint.with_cpu``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, cast

from cachekeeper.errors import InvalidManifest

if TYPE_CHECKING:  # mypy's; at run time the annotations stay text (no typing_extensions)
    from typing_extensions import ReadOnly

__all__ = ["CpuState", "Fingerprint", "Gpu", "parse"]


class Gpu(TypedDict):
    """One visible GPU: its CUDA index (in ``CUDA_VISIBLE_DEVICES`` order), its model and
    compute capability (``"9.0"``)."""

    index: ReadOnly[int]
    name: ReadOnly[str]
    capability: ReadOnly[str]


class CpuState(TypedDict):
    """The fingerprint's ``cpu`` field (schema 2): what changes Inductor's CPU kernels
    (``cachekeeper.environment.cpu``). ``threads_from`` says where the count came from; it is shown,
    never compared (``cpu.COMPARED``) and not in the digest (``PROVENANCE``)."""

    threads: ReadOnly[int]
    threads_from: ReadOnly[str]
    isa: ReadOnly[str | None]
    aten_cpu_capability: ReadOnly[str | None]


class Fingerprint(TypedDict, total=False):
    """The environment a cache was built under, as ``collect`` makes it and its JSON holds
    it (see the module docstring for why every field may be absent)."""

    schema: ReadOnly[int]  # SCHEMA of the cachekeeper that collected it
    torch: ReadOnly[str | None]  # with its local build tag: "2.11.0+cu130"
    triton: ReadOnly[str | None]
    cuda: ReadOnly[str | None]  # the CUDA torch was built with
    cuda_wheels: ReadOnly[Mapping[str, str]]  # installed nvidia-* wheels: version
    driver: ReadOnly[str | None]
    gpus: ReadOnly[Sequence[Gpu]]  # every visible GPU; [] on a CPU-only machine
    python: ReadOnly[str | None]  # major.minor
    arch: ReadOnly[str | None]  # platform.machine()
    env: ReadOnly[Mapping[str, str]]  # the variables that change keys (_compile_env)
    cpu: ReadOnly[CpuState]  # absent in schema 1


# What ``parse`` checks of each field: "text" (a string or null), "int", "names" (an
# object of strings), "gpus" (a list of Gpu), "cpu" (a CpuState).
_FIELD_KINDS = {
    "schema": "int",
    "torch": "text",
    "triton": "text",
    "cuda": "text",
    "cuda_wheels": "names",
    "driver": "text",
    "gpus": "gpus",
    "python": "text",
    "arch": "text",
    "env": "names",
    "cpu": "cpu",
}
_GPU_KINDS = {"index": "int", "name": "str", "capability": "str"}
_CPU_KINDS = {"threads": "int", "threads_from": "str", "isa": "text", "aten_cpu_capability": "text"}


def parse(raw: Any, *, where: str = "fingerprint") -> Fingerprint:
    """``raw`` (decoded JSON: a manifest's or a request's fingerprint) as a ``Fingerprint``.

    The same object, checked, never copied or rebuilt: its digest is the one it came with.
    Each field this version knows must have its type when present; absent fields and
    fields it does not know are fine (older and newer fingerprints parse). Raises
    ``InvalidManifest`` naming the first bad field: ``fingerprint field gpus[0].index:
    expected an integer, got str``.
    """
    if not isinstance(raw, dict):
        raise InvalidManifest(f"{where} is not an object")
    for name, kind in _FIELD_KINDS.items():
        if name in raw:
            problem = _problem(kind, raw[name], name)
            if problem is not None:
                raise InvalidManifest(f"{where} field {problem}")
    return cast(Fingerprint, raw)


def _problem(kind: str, value: Any, path: str) -> str | None:
    """Why ``value`` is not of ``kind`` (``_FIELD_KINDS``), naming its ``path``, or None."""
    if kind == "text":
        ok = value is None or isinstance(value, str)
        return None if ok else f"{path}: expected a string or null, got {_kind(value)}"
    if kind == "str":
        return None if isinstance(value, str) else f"{path}: expected a string, got {_kind(value)}"
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"{path}: expected an integer, got {_kind(value)}"
    if kind == "names":
        if not isinstance(value, dict):
            return f"{path}: expected an object, got {_kind(value)}"
        for key, item in value.items():
            if not isinstance(item, str):
                return f"{path}.{key}: expected a string, got {_kind(item)}"
        return None
    if kind == "gpus":
        if not isinstance(value, list):
            return f"{path}: expected a list, got {_kind(value)}"
        for i, gpu in enumerate(value):
            problem = _object_problem(_GPU_KINDS, gpu, f"{path}[{i}]")
            if problem is not None:
                return problem
        return None
    return _object_problem(_CPU_KINDS, value, path)  # "cpu"


def _object_problem(kinds: Mapping[str, str], value: Any, path: str) -> str | None:
    """Why ``value`` is not an object holding every field of ``kinds``, or None."""
    if not isinstance(value, dict):
        return f"{path}: expected an object, got {_kind(value)}"
    for name, kind in kinds.items():
        if name not in value:
            return f"{path}.{name}: missing"
        problem = _problem(kind, value[name], f"{path}.{name}")
        if problem is not None:
            return problem
    return None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
