"""The object store backend: blobs and snapshot archives on S3-compatible object storage
(``--blob-store s3://B/P``).

The second ``BlobBackend`` (``cachekeeper/backends/base.py``) beside
``cachekeeper.backends.local.LocalBackend``, and the one with ``DirectAccess``: nodes PUT blobs
and GET archives by presigned URL (``direct_access()`` is the store itself). Endpoint,
region and credentials come from the standard AWS configuration chain (boto3:
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, profiles); boto3 signs every request
and every presigned URL (SigV4). Layout under ``PREFIX``::

    blobs/<sha256>                 # a blob's uncompressed bytes, named by their sha256
    archives/<snapshot id>.tar.zst # a published snapshot's archive (GET .../archive format)

A blob is stored uncompressed so that its name is also its ``x-amz-checksum-sha256``: a
node's presigned PUT carries that header (signed into the URL), and a store that checks
it refuses wrong bytes itself. Not every store checks (moto does not), so the server never
relies on it: publish reads every new blob back and hashes it (``server.packing``).
``open_raw`` compresses on the fly into one zstd frame, which is what the archive stream
splices. Nodes download the compressed archive object, never the blobs.

boto3 is the server's extra (the base install has none): ``cachekeeper/backends/registry.py``
imports this module only when an ``s3://`` store is opened.
"""

from __future__ import annotations

import base64
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import boto3
import zstandard
from botocore.config import Config
from botocore.exceptions import ClientError

from cachekeeper.errors import (
    BlobMissing,
    ConfigInvalid,
)
from cachekeeper.integrity import copy_verified, is_digest, require_digest
from cachekeeper.wire import Upload

from .base import BlobStat, PutResult

__all__ = ["S3Backend", "S3Location", "checksum_b64", "parse_s3_url"]

_SPOOL_BYTES = 8 << 20  # a put keeps up to this much in memory before spilling to disk
STAT_WORKERS = 8  # HEADs in flight in ``stat_many`` (each waits on the store's latency)
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending in "/"


def parse_s3_url(url: str) -> S3Location:
    """``s3://BUCKET/PREFIX`` -> S3Location; raises ConfigInvalid naming the value."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ConfigInvalid(f"blob store {url!r} is not s3://BUCKET/PREFIX")
    prefix = parts.path.strip("/")
    return S3Location(parts.netloc, f"{prefix}/" if prefix else "")


def _is_missing(exc: ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code", "")) in _NOT_FOUND


def checksum_b64(digest: str) -> str:
    """The ``x-amz-checksum-sha256`` value of bytes whose sha256 hex is ``digest``."""
    return base64.b64encode(bytes.fromhex(digest)).decode("ascii")


class S3Backend:
    """Blobs (uncompressed, by sha256) and archives in one bucket under one prefix."""

    def __init__(self, location: S3Location, *, client: Any | None = None) -> None:
        self.location = location
        self.client = (
            client
            if client is not None
            else boto3.session.Session().client(
                "s3",
                config=Config(
                    signature_version="s3v4",
                    max_pool_connections=32,
                    retries={"max_attempts": 5, "mode": "standard"},
                ),
            )
        )
        # snapshot id (or "blob:<digest>") -> (presigned GET, when signed): a herd shares one
        # signature.
        self._archive_urls: dict[str, tuple[str, float]] = {}
        self._archive_urls_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> S3Backend:
        return cls(parse_s3_url(url))

    @property
    def url(self) -> str:
        return f"s3://{self.location.bucket}/{self.location.prefix}"

    def check(self) -> None:
        """Fail now (one line naming the bucket) when the bucket cannot be reached."""
        try:
            self.client.head_bucket(Bucket=self.location.bucket)
        except Exception as exc:  # noqa: BLE001 - any cause: the serve command says it in one line
            raise ConfigInvalid(f"blob store {self.url}: bucket not reachable: {exc}") from exc

    # -- keys -------------------------------------------------------------------------
    def key_for(self, digest: str) -> str:
        return f"{self.location.prefix}blobs/{require_digest(digest)}"

    def archive_key(self, snapshot_id: str) -> str:
        require_digest(snapshot_id, what="snapshot id")
        return f"{self.location.prefix}archives/{snapshot_id}.tar.zst"

    # -- BlobBackend (cachekeeper/backends/base.py) -------------------------------------
    def stat(self, digest: str) -> BlobStat | None:
        head = self._head(self.key_for(digest))
        if head is None:
            return None
        return BlobStat(
            digest=digest,
            stored_bytes=int(head["ContentLength"]),
            modified_at=head["LastModified"].timestamp(),
        )

    def stat_many(self, digests: Iterable[str]) -> dict[str, BlobStat | None]:
        """``stat`` of each of ``digests`` (one HEAD each, ``STAT_WORKERS`` at once)."""
        wanted = list(dict.fromkeys(digests))
        with ThreadPoolExecutor(max_workers=STAT_WORKERS, thread_name_prefix="ck-stat") as pool:
            return dict(zip(wanted, pool.map(self.stat, wanted), strict=True))

    def open(self, digest: str) -> BinaryIO:
        """The blob's bytes as stored (uncompressed); raises BlobMissing."""
        return self.open_dated(digest)[0]

    def open_dated(self, digest: str) -> tuple[BinaryIO, float]:
        """The blob's bytes and the object's last-modified time (one GET); raises BlobMissing."""
        try:
            answer = self.client.get_object(Bucket=self.location.bucket, Key=self.key_for(digest))
        except ClientError as exc:
            if _is_missing(exc):
                raise BlobMissing(
                    f"blob {digest} is not in {self.url}", extra={"missing": [digest]}
                ) from exc
            raise
        body: BinaryIO = answer["Body"]
        modified_at: float = answer["LastModified"].timestamp()
        return body, modified_at

    def open_raw(self, digest: str) -> BinaryIO:
        """The blob as one zstd frame (compressed while read, content size in the header)."""
        head = self._head(self.key_for(digest))
        if head is None:
            raise BlobMissing(f"blob {digest} is not in {self.url}", extra={"missing": [digest]})
        reader = zstandard.ZstdCompressor(level=1).stream_reader(
            self.open(digest), size=int(head["ContentLength"]), closefd=True
        )
        return reader  # type: ignore[return-value]

    def put(
        self, chunks: Iterable[bytes], *, digest: str, size_bytes: int | None = None
    ) -> PutResult:
        """Hash ``chunks`` while spooling them, then upload with their checksum if they match."""
        key = self.key_for(digest)
        found = self.stat(digest)
        if found is not None:
            for _ in chunks:  # drain the body so the connection stays usable
                pass
            return PutResult(digest, found.stored_bytes, found.stored_bytes, created=False)
        with tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES) as spool:
            total = copy_verified(chunks, spool.write, digest=digest, size_bytes=size_bytes)
            spool.seek(0)
            self.client.put_object(
                Bucket=self.location.bucket,
                Key=key,
                Body=spool,
                ContentLength=total,
                ChecksumSHA256=checksum_b64(digest),
            )
        return PutResult(digest, total, total, created=True)

    def delete(self, digest: str) -> bool:
        with self._archive_urls_lock:
            self._archive_urls.pop(f"blob:{digest}", None)
        return self._delete(self.key_for(digest))

    def scan(self) -> Iterator[BlobStat]:
        """Every blob object with its size and age."""
        for item in self._list(f"{self.location.prefix}blobs/"):
            name = item["Key"].rsplit("/", 1)[-1]
            if is_digest(name):
                yield BlobStat(name, int(item["Size"]), item["LastModified"].timestamp())

    def direct_access(self) -> S3Backend:
        """Nodes reach the object store by presigned URLs: it is its own direct access."""
        return self

    # -- DirectAccess -------------------------------------------------------------------
    def upload_target(self, digest: str, *, expires_s: int) -> Upload:
        """A presigned PUT of blob ``digest`` carrying its sha256 as ``x-amz-checksum-sha256``
        (signed into the URL: a store that checks it refuses other bytes; publish hashes
        them again regardless, ``server.packing``)."""
        return Upload(
            digest=digest,
            url=self.presigned_url(digest, method="PUT", expires_s=expires_s),
            headers={"x-amz-checksum-sha256": checksum_b64(digest)},
        )

    def blob_url(self, digest: str, *, expires_s: int = 900) -> str:
        """A presigned GET of blob ``digest``, valid for at least 2/3 of ``expires_s``: a
        per-key tier value that a herd of nodes asks for shares one signature (signing
        costs the server more CPU than the rest of the GET), as ``archive_url`` does."""
        return self._reused_url(
            f"blob:{digest}",
            expires_s,
            lambda: self.presigned_url(digest, method="GET", expires_s=expires_s),
        )

    def presigned_url(self, digest: str, *, method: str = "GET", expires_s: int = 900) -> str:
        """A URL a node uses directly; a PUT's URL requires the blob's sha256 checksum header."""
        params: dict[str, Any] = {"Bucket": self.location.bucket, "Key": self.key_for(digest)}
        if method == "PUT":
            params["ChecksumSHA256"] = checksum_b64(digest)
            operation = "put_object"
        elif method == "GET":
            operation = "get_object"
        else:
            raise ValueError(f"presigned_url: method {method!r} is not GET or PUT")
        url: str = self.client.generate_presigned_url(operation, Params=params, ExpiresIn=expires_s)
        return url

    # -- archives -----------------------------------------------------------------------
    def put_archive(self, snapshot_id: str, path: Path) -> tuple[int, str]:
        """Upload the archive file at ``path`` (multipart when large); (its size in bytes,
        the object's ETag as the store reports it)."""
        key = self.archive_key(snapshot_id)
        self.client.upload_file(str(path), self.location.bucket, key)
        head = self._head(key)
        return os.path.getsize(path), "" if head is None else str(head.get("ETag", ""))

    def has_archive(self, snapshot_id: str) -> bool:
        return self._head(self.archive_key(snapshot_id)) is not None

    def archive_etag(self, snapshot_id: str) -> str | None:
        """The archive object's ETag now (None: there is none); any rewrite changes it."""
        head = self._head(self.archive_key(snapshot_id))
        return None if head is None else str(head.get("ETag", ""))

    def open_archive(self, snapshot_id: str) -> BinaryIO:
        try:
            answer = self.client.get_object(
                Bucket=self.location.bucket, Key=self.archive_key(snapshot_id)
            )
        except ClientError as exc:
            if _is_missing(exc):
                raise BlobMissing(f"the archive of {snapshot_id} is not in {self.url}") from exc
            raise
        body: BinaryIO = answer["Body"]
        return body

    def archive_url(self, snapshot_id: str, *, expires_s: int = 900) -> str:
        """A presigned GET of the snapshot's archive, valid for at least 2/3 of ``expires_s``.

        Signing costs the server a few milliseconds of CPU, as much as the rest of a
        resolve, and every node of a job start asks for the same snapshot: a URL is reused
        for the first third of its life, so a node never gets one that expires sooner.
        """
        return self._reused_url(
            snapshot_id,
            expires_s,
            lambda: self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.location.bucket, "Key": self.archive_key(snapshot_id)},
                ExpiresIn=expires_s,
            ),
        )

    def _reused_url(self, name: str, expires_s: int, sign: Callable[[], str]) -> str:
        """The URL ``sign`` made for ``name`` less than a third of ``expires_s`` ago, else a
        new one (kept for the next caller)."""
        now = time.monotonic()
        with self._archive_urls_lock:
            cached = self._archive_urls.get(name)
        if cached is not None and now - cached[1] < expires_s / 3:
            return cached[0]
        url = str(sign())
        with self._archive_urls_lock:
            if len(self._archive_urls) >= 4096:  # bounded: old entries are only an optimization
                self._archive_urls.clear()
            self._archive_urls[name] = (url, now)
        return url

    def delete_archive(self, snapshot_id: str) -> bool:
        with self._archive_urls_lock:
            self._archive_urls.pop(snapshot_id, None)
        return self._delete(self.archive_key(snapshot_id))

    def archives(self) -> Iterator[BlobStat]:
        """Every archive object, named by its snapshot id, with its size and age."""
        for item in self._list(f"{self.location.prefix}archives/"):
            name = item["Key"].rsplit("/", 1)[-1].removesuffix(".tar.zst")
            if is_digest(name):
                yield BlobStat(name, int(item["Size"]), item["LastModified"].timestamp())

    # -- helpers --------------------------------------------------------------------------
    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            head: dict[str, Any] = self.client.head_object(Bucket=self.location.bucket, Key=key)
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise
        return head

    def _delete(self, key: str) -> bool:
        if self._head(key) is None:
            return False
        self.client.delete_object(Bucket=self.location.bucket, Key=key)
        return True

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, Prefix=prefix
        )
        for page in pages:
            yield from page.get("Contents", [])
