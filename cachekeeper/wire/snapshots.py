"""Blobs and snapshots: upload, publish, list and archive requests."""

from __future__ import annotations

from dataclasses import dataclass

from ._core import Digest, DigestList
from .resolve import Summary

# -- blobs and snapshots ----------------------------------------------------------------------


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
