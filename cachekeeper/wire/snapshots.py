"""Blobs and snapshots: upload, publish, list and archive requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ._core import Check, Digest, DigestList
from .resolve import Summary

# The most digests one ``POST /v1/blobs/missing`` may name. On an object-store server each
# missing one costs a presigned PUT (about 0.2 ms of the server's CPU), so the bound keeps
# one request under about a second of it; push asks 1,000 at a time.
MAX_MISSING_DIGESTS = 5_000

# -- blobs and snapshots ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MissingRequest:
    """``POST /v1/blobs/missing``: at most ``MAX_MISSING_DIGESTS`` digests."""

    digests: Annotated[list[Digest], Check(max_length=MAX_MISSING_DIGESTS)]


@dataclass(frozen=True, kw_only=True)
class Upload:
    """Where a node PUTs one missing blob itself: its uncompressed bytes, with ``headers``."""

    digest: Digest
    url: str
    headers: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class MissingAnswer:
    missing: tuple[Digest, ...]
    # From a server whose blobs are in an object store, to a write-scope caller: a
    # presigned PUT per missing blob. Empty from a local-dir server, to a read-scope or
    # anonymous caller, and from old servers: blobs go to PUT /v1/blobs/{digest}.
    uploads: tuple[Upload, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PutAnswer:
    """``PUT /v1/blobs/{digest}``: 201 when stored now, 200 when it was already there."""

    digest: Digest
    size_bytes: int
    created: bool


@dataclass(frozen=True, kw_only=True)
class PublishAnswer(Summary):
    """``POST /v1/snapshots``: 201 with ``created``, 200 without for an identical manifest.

    ``offered``: whether resolve hands this snapshot to nodes; False for a harvested delta
    on a server that does not serve them (``serve --serve-harvested``).
    """

    created: bool
    offered: bool = True


@dataclass(frozen=True, kw_only=True)
class SnapshotList:
    snapshots: tuple[Summary, ...]


@dataclass(frozen=True, kw_only=True)
class ArchiveRequest:
    """``POST /v1/snapshots/{id}/archive``: the blobs to put in the stream."""

    digests: DigestList
