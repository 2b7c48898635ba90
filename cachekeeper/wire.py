"""The HTTP API's wire shapes: every JSON request and answer body, in one place.

Stdlib only (no pydantic, no torch): the server uses these classes as FastAPI body and
response types, the client and the pre-job hook parse answers with ``from_dict``, and
docs/api.md describes them. A route's raw bodies (a manifest, blob bytes, workload TOML,
an archive stream) are not shapes and are not here.

``from_dict(Cls, data)`` builds a shape from decoded JSON, recursively (nested shapes,
tuples, optionals, literals), and raises ``WireError`` naming the first offending field;
keys it does not know are ignored, so a server may add fields. A field added later must
have a default, so answers of older servers still parse. ``to_dict(shape)`` is the
reverse (tuples become lists).

Answers hold tuples; request bodies hold lists, so that pydantic's 422 messages
("List should have at most ...") stay what they were.

Field constraints (a digest's pattern, a list's length) are ``Check`` metadata:
``from_dict`` enforces them, and pydantic, which calls ``Check.__get_pydantic_core_schema__``
when the server builds its validators, enforces and documents them in the OpenAPI schema.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

__all__ = [
    "WireError",
    "DIGEST_PATTERN",
    "Check",
    "from_dict",
    "to_dict",
    "Health",
    "ErrorBody",
    "Mismatch",
    "Summary",
    "ResolveRequest",
    "NearMiss",
    "ResolveAnswer",
    "MissingRequest",
    "MissingAnswer",
    "Upload",
    "PutAnswer",
    "PublishAnswer",
    "SnapshotList",
    "ArchiveRequest",
    "WorkloadInfo",
    "WorkloadList",
    "AgentRegistration",
    "AgentInfo",
    "RegisterAnswer",
    "AgentList",
    "AgentEvent",
    "EventOut",
    "JobReport",
    "JobReportAnswer",
    "JobStats",
    "StatusRow",
    "StatusAnswer",
    "GcRequest",
    "GcAnswer",
]

T = TypeVar("T")

DIGEST_PATTERN = r"^[0-9a-f]{64}$"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
AGENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$"


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
EventStatus = Literal["built", "skipped", "building", "cold_compile_broken", "failed"]
PairStatus = Literal["warm", "building", "broken", "failed", "missing"]
Count = Annotated[int, Check(ge=0, le=2**48)]  # a count or byte total (SQLite holds it)
JobPhase = Literal["prejob", "postjob"]
# prejob: restored, already_restored or cold; postjob: compiled (new entries) or clean.
JobOutcome = Literal["restored", "already_restored", "cold", "compiled", "clean"]


# -- health and errors ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Health:
    """``GET /healthz``."""

    status: str
    version: str


@dataclass(frozen=True, kw_only=True)
class ErrorBody:
    """Every error answer; some codes add fields (``missing``, ``expected``, ``actual``)."""

    error: str
    detail: str


# -- resolve ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """One field on which a node and a snapshot's builder differ."""

    field: str
    node: Any = None
    snapshot: Any = None

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


@dataclass(frozen=True, kw_only=True)
class Summary:
    """A stored snapshot as the API lists it (SUMMARY in docs/api.md)."""

    id: Digest
    workload: str | None
    fingerprint_digest: str
    devices: tuple[str, ...]
    verified: bool
    signed: bool
    size_bytes: int
    file_count: int
    created_at: str
    last_used_at: str | None
    pinned: bool


@dataclass(frozen=True, kw_only=True)
class ResolveRequest:
    """``POST /v1/resolve``."""

    fingerprint: dict[str, Any]
    workload: str | None = None
    driver_policy: DriverPolicy = "newer"
    devices: Annotated[list[str], Check(max_length=1024)] | None = None


@dataclass(frozen=True, kw_only=True)
class NearMiss:
    """A snapshot of the workload this node cannot use, and why."""

    snapshot: Summary
    mismatches: tuple[Mismatch, ...]

    @property
    def snapshot_id(self) -> str:
        return self.snapshot.id


@dataclass(frozen=True, kw_only=True)
class ResolveAnswer:
    """The best snapshot for a node, or ``snapshot: None`` (a miss is a value)."""

    snapshot: Summary | None
    verified: bool
    exact: bool
    near_misses: tuple[NearMiss, ...]
    reason: str | None = None  # on a miss, why (one sentence); None on a hit and from old servers
    # On a hit from a server whose blobs are in an object store: a short-lived presigned GET
    # URL of the snapshot's archive (the format of GET /v1/snapshots/{id}/archive). None
    # from a local-dir server and from old servers: the node uses the archive route.
    archive_url: str | None = None
    # Harvested deltas of ``snapshot`` for this environment (oldest first), restored after
    # it; only from a server run with --serve-harvested, else empty.
    deltas: tuple[Summary, ...] = ()

    @property
    def snapshot_id(self) -> str | None:
        return None if self.snapshot is None else self.snapshot.id


# -- blobs and snapshots ----------------------------------------------------------------------

DigestList = Annotated[list[Digest], Check(max_length=1_000_000)]


@dataclass(frozen=True, kw_only=True)
class MissingRequest:
    """``POST /v1/blobs/missing``."""

    digests: DigestList


@dataclass(frozen=True, kw_only=True)
class Upload:
    """Where a node PUTs one missing blob itself: its uncompressed bytes, with ``headers``."""

    digest: Digest
    url: str
    headers: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class MissingAnswer:
    missing: tuple[Digest, ...]
    # From a server whose blobs are in an object store: a presigned PUT per missing blob.
    # Empty from a local-dir server and from old servers: blobs go to PUT /v1/blobs/{digest}.
    uploads: tuple[Upload, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PutAnswer:
    """``PUT /v1/blobs/{digest}``: 201 when stored now, 200 when it was already there."""

    digest: Digest
    size_bytes: int
    created: bool


@dataclass(frozen=True, kw_only=True)
class PublishAnswer(Summary):
    """``POST /v1/snapshots``: 201 with ``created``, 200 without for an identical manifest."""

    created: bool


@dataclass(frozen=True, kw_only=True)
class SnapshotList:
    snapshots: tuple[Summary, ...]


@dataclass(frozen=True, kw_only=True)
class ArchiveRequest:
    """``POST /v1/snapshots/{id}/archive``: the blobs to put in the stream."""

    digests: DigestList


# -- workloads --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WorkloadInfo:
    name: str
    digest: str
    updated_at: str


@dataclass(frozen=True, kw_only=True)
class WorkloadList:
    workloads: tuple[WorkloadInfo, ...]


# -- agents and status ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AgentRegistration:
    """``POST /v1/agents``."""

    name: Annotated[str, Check(pattern=AGENT_NAME_PATTERN)]
    fingerprint: dict[str, Any]
    fingerprint_digest: Annotated[str, Check(pattern=DIGEST_PATTERN)] | None = None
    gpus: Annotated[list[dict[str, Any]], Check(max_length=1024)] = field(default_factory=list)
    devices: Annotated[list[str], Check(max_length=1024)] = field(default_factory=list)
    version: Annotated[str, Check(max_length=64)] = ""


@dataclass(frozen=True, kw_only=True)
class AgentInfo:
    """A registered agent (AGENT in docs/api.md)."""

    id: str
    name: str
    fingerprint_digest: str
    fingerprint: dict[str, Any]
    devices: tuple[str, ...]
    gpus: tuple[dict[str, Any], ...]
    version: str
    registered_at: str
    last_seen_at: str


@dataclass(frozen=True, kw_only=True)
class RegisterAnswer(AgentInfo):
    created: bool


@dataclass(frozen=True, kw_only=True)
class AgentList:
    agents: tuple[AgentInfo, ...]


@dataclass(frozen=True, kw_only=True)
class AgentEvent:
    """``POST /v1/agents/{id}/events``: one build outcome, or a build starting."""

    workload: Annotated[str, Check(pattern=NAME_PATTERN)]
    fingerprint_digest: Digest
    status: EventStatus
    detail: Annotated[str, Check(max_length=8000)] = ""
    traceback_tail: Annotated[
        list[Annotated[str, Check(max_length=2000)]], Check(max_length=100)
    ] = field(default_factory=list)
    snapshot_id: Digest | None = None
    seconds: Annotated[float, Check(ge=0)] | None = None


@dataclass(frozen=True, kw_only=True)
class EventOut(AgentEvent):
    """An event as stored (EVENT in docs/api.md)."""

    id: int
    at: str
    agent_id: str


# -- job reports (DESIGN section 7) ----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class JobReport:
    """``POST /v1/reports``: what one end of a training job saw on one node.

    ``prejob``: the restore (``restored``, ``already_restored``) or a ``cold`` start with
    its ``reason`` (text) and ``reason_code`` (the error code). ``postjob``: what the job
    compiled on top of the restored snapshot (``compiled``, with the ``new_*`` counts and
    bytes) or nothing (``clean``).
    """

    phase: JobPhase
    outcome: JobOutcome
    workload: Annotated[str, Check(pattern=NAME_PATTERN)]
    fingerprint_digest: Digest
    snapshot_id: Digest | None = None
    node: Annotated[str, Check(max_length=256)] = ""
    devices: Annotated[list[Annotated[str, Check(max_length=32)]], Check(max_length=1024)] = field(
        default_factory=list
    )
    reason: Annotated[str, Check(max_length=2000)] | None = None
    reason_code: Annotated[str, Check(pattern=r"^[a-z_]{1,64}$")] | None = None
    new_fxgraph: Count = 0
    new_aotautograd: Count = 0
    new_triton: Count = 0
    new_other: Count = 0  # files of Inductor's code cache and the rest
    new_bytes: Count = 0
    started_at: Annotated[str, Check(max_length=64)] | None = None
    finished_at: Annotated[str, Check(max_length=64)] | None = None


@dataclass(frozen=True, kw_only=True)
class JobReportAnswer:
    id: int
    at: str


@dataclass(frozen=True, kw_only=True)
class JobStats:
    """The job reports of one (workload, fingerprint digest), added up (a status row's ``jobs``)."""

    workload: str
    fingerprint_digest: str
    restores: int  # prejob restored a snapshot (or found it already there)
    cold: int  # prejob started cold
    cold_reasons: dict[str, int]  # reason_code -> count
    postjobs: int  # postjob reports
    compiled: int  # postjob reports with new entries
    compiled_after_restore: int  # of those, jobs that had a snapshot restored
    new_graphs: int  # FX-graph + AOTAutograd entries those jobs compiled
    new_bytes: int
    last_report_at: str

    @property
    def mismatch_note(self) -> str | None:
        """What a restored-but-compiled-anyway count means, or None."""
        if not self.compiled_after_restore:
            return None
        return (
            f"restored, but {self.compiled_after_restore} job(s) compiled {self.new_graphs}"
            " graph(s) anyway: the workload file does not match training; run `cachekeeper"
            " explain` and see docs/workloads.md"
        )


@dataclass(frozen=True, kw_only=True)
class StatusRow:
    """One (workload, fingerprint digest) pair of ``GET /v1/status``."""

    workload: str
    fingerprint_digest: str
    status: PairStatus
    snapshot_id: str | None
    updated_at: str | None
    last_event: EventOut | None
    agents: tuple[str, ...]
    devices: tuple[str, ...] = ()  # what the row's snapshot covers
    uncovered: tuple[str, ...] = ()  # of ?devices=, what it does not cover
    note: str | None = None  # what to do about ``uncovered``
    jobs: JobStats | None = None  # what jobs reported (POST /v1/reports); None: no report
    jobs_note: str | None = None  # "restored, but N jobs compiled anyway", what to do


@dataclass(frozen=True, kw_only=True)
class StatusAnswer:
    status: tuple[StatusRow, ...]


# -- gc ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GcRequest:
    dry_run: bool = False


@dataclass(frozen=True, kw_only=True)
class GcAnswer:
    snapshots_evicted: tuple[str, ...]
    blobs_deleted: int
    bytes_freed: int
    dry_run: bool


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
