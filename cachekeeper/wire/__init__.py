"""The HTTP API's wire shapes: every JSON request and answer body, in one package.

Stdlib only (no pydantic, no torch): the server uses these classes as FastAPI body and
response types, the client and the pre-job hook parse answers with ``from_dict``, and
docs/api.md describes them. A route's raw bodies (a manifest, blob bytes, workload TOML,
an archive stream) are not shapes and are not here.

``from_dict(Cls, data)`` builds a shape from decoded JSON, recursively (nested shapes,
tuples, optionals, literals), and raises ``WireError`` naming the first offending field;
keys it does not know are ignored, so a server may add fields. A field added later must
have a default, so answers of older servers still parse. ``to_dict(shape)`` is the
reverse (tuples become lists). ``utc_now()`` is the text of every ``*_at`` field.

Answers hold tuples; request bodies hold lists, so that pydantic's 422 messages
("List should have at most ...") stay what they were.

Field constraints (a digest's pattern, a list's length) are ``Check`` metadata:
``from_dict`` enforces them, and pydantic, which calls ``Check.__get_pydantic_core_schema__``
when the server builds its validators, enforces and documents them in the OpenAPI schema.

One module per group of routes (``resolve``, ``snapshots``, ``reports``, ``fleet``,
``admin``, ``tier``) and the building blocks in ``_core``. Import the shapes from the package
(``from cachekeeper.wire import ResolveAnswer``): a shape's module loads on first use, so
the pre-job hook builds only the few classes it needs (a dataclass costs about a
millisecond to create, and the hook's start-up budget is 300 ms; see docs/benchmarks.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachekeeper._lazy import lazy_getattr

from ._core import (  # the building blocks, and the field types routes and tables share
    AGENT_NAME_PATTERN,
    DIGEST_PATTERN,
    NAME_PATTERN,
    Check,
    Count,
    Digest,
    DigestList,
    DriverPolicy,
    EventStatus,
    JobOutcome,
    JobPhase,
    PairStatus,
    WireError,
    from_dict,
    to_dict,
    utc_now,
)

if TYPE_CHECKING:  # the shapes, for type checkers; at run time __getattr__ loads them
    from .admin import ErrorBody, GcAnswer, GcRequest, Health, WorkloadInfo, WorkloadList
    from .fleet import (
        AgentEvent,
        AgentInfo,
        AgentList,
        AgentRegistration,
        EventOut,
        RegisterAnswer,
        StatusAnswer,
        StatusRow,
    )
    from .reports import JobReport, JobReportAnswer, JobStats
    from .resolve import (
        Mismatch,
        NearMiss,
        RemoteCacheOffer,
        ResolveAnswer,
        ResolveRequest,
        Summary,
    )
    from .snapshots import (
        ArchiveRequest,
        MissingAnswer,
        MissingRequest,
        PublishAnswer,
        PutAnswer,
        SnapshotList,
        Upload,
    )
    from .tier import TierCommitRequest, TierPutAnswer, TierPutRequest

__all__ = [
    "WireError",
    "DIGEST_PATTERN",
    "NAME_PATTERN",
    "AGENT_NAME_PATTERN",
    "Check",
    "from_dict",
    "to_dict",
    "utc_now",
    "Digest",
    "DigestList",
    "Count",
    "DriverPolicy",
    "EventStatus",
    "PairStatus",
    "JobPhase",
    "JobOutcome",
    "Health",
    "ErrorBody",
    "Mismatch",
    "Summary",
    "ResolveRequest",
    "RemoteCacheOffer",
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
    "TierPutRequest",
    "TierPutAnswer",
    "TierCommitRequest",
]

_MODULE_OF = {
    "Health": "admin",
    "ErrorBody": "admin",
    "WorkloadInfo": "admin",
    "WorkloadList": "admin",
    "GcRequest": "admin",
    "GcAnswer": "admin",
    "Mismatch": "resolve",
    "Summary": "resolve",
    "ResolveRequest": "resolve",
    "RemoteCacheOffer": "resolve",
    "NearMiss": "resolve",
    "ResolveAnswer": "resolve",
    "MissingRequest": "snapshots",
    "Upload": "snapshots",
    "MissingAnswer": "snapshots",
    "PutAnswer": "snapshots",
    "PublishAnswer": "snapshots",
    "SnapshotList": "snapshots",
    "ArchiveRequest": "snapshots",
    "JobReport": "reports",
    "JobReportAnswer": "reports",
    "JobStats": "reports",
    "AgentRegistration": "fleet",
    "AgentInfo": "fleet",
    "RegisterAnswer": "fleet",
    "AgentList": "fleet",
    "AgentEvent": "fleet",
    "EventOut": "fleet",
    "StatusRow": "fleet",
    "StatusAnswer": "fleet",
    "TierPutRequest": "tier",
    "TierPutAnswer": "tier",
    "TierCommitRequest": "tier",
}


__getattr__ = lazy_getattr(__name__, _MODULE_OF)  # a shape, from its module, on first use


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
