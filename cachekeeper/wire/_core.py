"""The building blocks of the wire shapes: ``WireError``, ``Check``, the shared field
types, ``utc_now`` (the text of every ``*_at`` field), and ``from_dict`` / ``to_dict``
(see the package docstring)."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

from cachekeeper.integrity import DIGEST_PATTERN

T = TypeVar("T")

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
AGENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$"


def utc_now() -> str:
    """The current UTC time as every ``*_at`` field carries it: ISO 8601 with microseconds
    (``2026-01-02T03:04:05.123456+00:00``), so times sort as text."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


class WireError(ValueError):
    """A JSON body that does not have the shape its route promises."""


@dataclass(frozen=True)
class Check:
    """Constraints on one field: a regex, a length (strings and lists), a minimum."""

    pattern: str | None = None
    max_length: int | None = None
    ge: float | None = None
    le: float | None = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` breaks this check, or None."""
        if self.pattern is not None and not re.search(self.pattern, value):
            return f"does not match {self.pattern}"
        if self.max_length is not None and len(value) > self.max_length:
            return f"is longer than {self.max_length}"
        if self.ge is not None and value < self.ge:
            return f"is less than {self.ge:g}"
        if self.le is not None and value > self.le:
            return f"is more than {self.le:g}"
        return None

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        """pydantic's hook for annotation metadata: add these constraints to its schema."""
        schema = handler(source)
        for key in ("pattern", "max_length", "ge", "le"):
            if getattr(self, key) is not None:
                schema[key] = getattr(self, key)
        return schema


Digest = Annotated[str, Check(pattern=DIGEST_PATTERN)]
DriverPolicy = Literal["newer", "exact", "any"]
# refused: the builder's allowlist (agent --allow) does not admit the workload's code.
EventStatus = Literal["built", "skipped", "building", "cold_compile_broken", "failed", "refused"]
PairStatus = Literal["warm", "building", "broken", "failed", "refused", "missing"]
Count = Annotated[int, Check(ge=0, le=2**48)]  # a count or byte total (SQLite holds it)
JobPhase = Literal["prejob", "postjob"]
# prejob: restored, already_restored or cold; postjob: compiled (new entries) or clean.
JobOutcome = Literal["restored", "already_restored", "cold", "compiled", "clean"]

DigestList = Annotated[list[Digest], Check(max_length=1_000_000)]


# -- from_dict / to_dict ----------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
    return hints


def from_dict(cls: type[T], data: Any, *, where: str = "") -> T:
    """``cls`` (a shape of this module) built from decoded JSON ``data``; raises WireError."""
    return _convert(cls, data, where or cls.__name__)  # type: ignore[no-any-return]


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise WireError(f"{where}: expected an object, got {_kind(data)}")
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            values[f.name] = _convert(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise WireError(f"{where}.{f.name}: missing")
    return cls(**values)


def _convert(tp: Any, value: Any, where: str) -> Any:
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *metadata = typing.get_args(tp)
        out = _convert(base, value, where)
        for check in metadata:
            problem = check.problem(out) if isinstance(check, Check) else None
            if problem is not None:
                raise WireError(f"{where}: {_clip(out)} {problem}")
        return out
    if origin is typing.Union or origin is types.UnionType:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, where)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(errors[0] if len(errors) == 1 else f"{where}: {_kind(value)} fits none")
    if origin is Literal:
        if value not in typing.get_args(tp) or isinstance(value, bool):
            raise WireError(f"{where}: {_clip(value)} is not one of {typing.get_args(tp)}")
        return value
    if origin is tuple or origin is list:
        if not isinstance(value, list | tuple):
            raise WireError(f"{where}: expected a list, got {_kind(value)}")
        item = typing.get_args(tp)[0]
        items = [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected an object, got {_kind(value)}")
        item = typing.get_args(tp)[1]
        return {str(k): _convert(item, v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)  # type: ignore[arg-type]
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (str, bool):
        if isinstance(value, tp):
            return value
    else:
        raise TypeError(f"{where}: wire shapes cannot hold {tp!r}")  # a bug in this module
    raise WireError(f"{where}: expected {tp.__name__}, got {_kind(value)}")


def to_dict(shape: Any) -> Any:
    """The JSON-ready form of a shape (dicts, lists and scalars), in field order."""
    if dataclasses.is_dataclass(shape) and not isinstance(shape, type):
        return {f.name: to_dict(getattr(shape, f.name)) for f in dataclasses.fields(shape)}
    if isinstance(shape, list | tuple):
        return [to_dict(v) for v in shape]
    if isinstance(shape, dict):
        return {k: to_dict(v) for k, v in shape.items()}
    return shape


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
