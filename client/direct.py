"""Straight to the object store: presigned GETs of archives and presigned PUTs of blobs.

When the server keeps its blobs in S3-compatible storage, ``resolve`` answers a
short-lived presigned URL of the snapshot's archive and ``blobs/missing`` presigned PUT
URLs, so the bytes go between the node and the store and the server answers only small
JSON. Nothing here signs anything: the URLs carry the server's signature. No
``Authorization`` header is ever sent to the store (the server's token is not the store's).

A download is parallel ranged GETs (``part_bytes`` each, ``parallel`` at once, kept in
order in a window), so one slow connection does not bound a node's rate. Any failure
(403 of an expired URL, another status, a broken connection) raises
``DirectUnavailable``; ``client.pull`` then falls back to the server's archive route.
Verification is the restore's, as for the server's stream: every byte is hashed there.

Bounded in time and memory, because the pre-job hook promises its deadline: each part is
streamed and checked against the deadline as its bytes arrive (a store that trickles a
byte a second cannot hold a part past it), a part holds at most the bytes it asked for
(a store that ignores ``Range`` may send the whole object only up to ``WHOLE_MAX_BYTES``),
and the parts are fetched by daemon threads (``cachekeeper.daemon_pool``), which never keep
the process alive after the hook has given up on them.
"""

from __future__ import annotations

import collections
import io
import re
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from cachekeeper.daemon_pool import DaemonPool
from cachekeeper.errors import ServerUnavailable
from cachekeeper.snapshot.archive import ReadAhead

from .calls import Backoff, Deadline, redact_url
from .transport import http_client, read_answer, send

if TYPE_CHECKING:
    import httpx

__all__ = ["DirectUnavailable", "ObjectStore", "Part", "PART_BYTES", "PARALLEL", "WHOLE_MAX_BYTES"]

PART_BYTES = 8 << 20
PARALLEL = 4
WHOLE_MAX_BYTES = 64 << 20  # the most a store that ignores Range may send in one answer
PUT_ANSWER_MAX_BYTES = 1 << 20  # a PUT's answer is empty, or an error of a few hundred bytes
# The transport's one retry rule, with this store's counts: a part asked twice at most
# (the parallel window has other parts to fetch meanwhile), a PUT sent three times.
RANGE_BACKOFF = Backoff(retries=1)
PUT_BACKOFF = Backoff(retries=2)
_RANGE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19})")


class DirectUnavailable(ServerUnavailable):
    """The object store refused or failed a presigned request (the caller falls back)."""


@dataclass(frozen=True)
class Part:
    """One answer of a ranged GET: 206 with the range asked, or 200 with the whole object."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes


class ObjectStore:
    """An httpx client for presigned URLs (``transport.http_client``: the one User-Agent and
    TLS context, no token); ``transport`` is the test seam, as CacheClient's."""

    def __init__(
        self, *, timeout_s: float = 30.0, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self._http = http_client(
            timeout_s=timeout_s, transport=transport, max_connections=PARALLEL * 2
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_range(self, url: str, start: int, end: int, *, deadline: Deadline | None) -> Part:
        """Bytes ``start..end`` (inclusive) of ``url`` (206), or the whole object (200, at
        most ``WHOLE_MAX_BYTES``); read as they arrive, never past ``deadline``. A part cut
        off or answered 5xx is asked again once (``RANGE_BACKOFF``)."""
        deadline = deadline or Deadline(None)
        where = redact_url(url, query=False)
        what = f"GET {where} bytes {start}-{end}"

        def read(response: httpx.Response) -> Part:
            status = response.status_code
            if status not in (200, 206):
                raise DirectUnavailable(
                    f"GET {where} answered HTTP {status}"
                    + (" (the presigned URL expired or was refused)" if status == 403 else "")
                )
            whole = read_answer(
                response,
                limit=end - start + 1 if status == 206 else WHOLE_MAX_BYTES,
                deadline=deadline,
                what=what,
                unavailable=DirectUnavailable,
                too_long=DirectUnavailable,
            )
            return Part(status, whole.headers, whole.content)

        return send(
            self._http,
            "GET",
            url,
            what=f"GET {where}",
            read=read,
            deadline=deadline,
            backoff=RANGE_BACKOFF,
            timeout_s=self.timeout_s,
            headers={"Range": f"bytes={start}-{end}"},
            unavailable=DirectUnavailable,
        )

    def open_archive(
        self,
        url: str,
        *,
        deadline: Deadline | None = None,
        part_bytes: int = PART_BYTES,
        parallel: int = PARALLEL,
    ) -> BinaryIO:
        """The archive at ``url`` as an uncompressed tar stream (read ahead in a thread).

        The first part is fetched before this returns, so a refused URL raises
        ``DirectUnavailable`` here, before anything was read.
        """
        import zstandard  # noqa: PLC0415 - hook start-up: only when a download happens

        raw = self.open_ranged(url, deadline=deadline, part_bytes=part_bytes, parallel=parallel)
        reader = zstandard.ZstdDecompressor().stream_reader(
            raw, read_across_frames=True, closefd=True
        )
        return cast(BinaryIO, ReadAhead(cast(BinaryIO, reader)))

    def open_ranged(
        self,
        url: str,
        *,
        deadline: Deadline | None = None,
        part_bytes: int = PART_BYTES,
        parallel: int = PARALLEL,
    ) -> BinaryIO:
        """The object at ``url`` as it is stored (no decompression): ``open_archive``'s
        parallel ranged GETs, in order. bench/direct_bench.py times this (transfer, not zstd).

        The first part is fetched before this returns (``DirectUnavailable`` if refused).
        """
        raw = _RangedReader(self, url, deadline=deadline, part_bytes=part_bytes, parallel=parallel)
        return cast(BinaryIO, raw)

    def put(
        self,
        url: str,
        *,
        open_body: Callable[[], Iterator[bytes]],
        size_bytes: int,
        headers: dict[str, str],
        deadline: Deadline | None = None,
    ) -> None:
        """PUT ``size_bytes`` from ``open_body()`` to a presigned URL; a PUT cut off or
        answered 5xx is sent again (``PUT_BACKOFF``)."""
        deadline = deadline or Deadline(None)
        what = f"PUT {redact_url(url, query=False)}"
        response = send(
            self._http,
            "PUT",
            url,
            what=what,
            read=lambda answer: read_answer(
                answer,
                limit=PUT_ANSWER_MAX_BYTES,
                deadline=deadline,
                what=what,
                unavailable=DirectUnavailable,
                too_long=DirectUnavailable,
            ),
            deadline=deadline,
            backoff=PUT_BACKOFF,
            timeout_s=self.timeout_s,
            open_body=open_body,
            headers={**headers, "Content-Length": str(size_bytes)},
            unavailable=DirectUnavailable,
        )
        if not response.is_success:
            raise DirectUnavailable(
                f"{what} answered HTTP {response.status_code}: {response.text[:200]!r}"
            )


class _RangedReader(io.RawIOBase):
    """A presigned object as a readable stream of parallel ranged GETs, in order."""

    def __init__(
        self,
        store: ObjectStore,
        url: str,
        *,
        deadline: Deadline | None,
        part_bytes: int,
        parallel: int,
    ) -> None:
        self._store = store
        self._url = url
        self._deadline = deadline
        first = store.get_range(url, 0, part_bytes - 1, deadline=deadline)
        found = _RANGE.fullmatch(first.headers.get("content-range", ""))
        if first.status_code == 200 or found is None:  # the store sent it whole
            total = len(first.content)
        else:
            total = int(found.group(3))
        self.total_bytes = total
        self._pending = memoryview(first.content)
        self._offsets = collections.deque(range(len(first.content), total, part_bytes))
        self._part_bytes = part_bytes
        self._pool = DaemonPool(parallel, name="ck-range")
        self._window: collections.deque[Future[bytes]] = collections.deque()
        self._parallel = parallel
        self._fill()

    def _fetch(self, start: int) -> bytes:
        end = min(start + self._part_bytes, self.total_bytes) - 1
        part = self._store.get_range(self._url, start, end, deadline=self._deadline)
        if part.status_code != 206 or len(part.content) != end - start + 1:
            where = redact_url(self._url, query=False)
            raise DirectUnavailable(
                f"GET {where} bytes {start}-{end}: got {len(part.content)} bytes"
            )
        return part.content

    def _fill(self) -> None:
        while self._offsets and len(self._window) < self._parallel * 2:
            self._window.append(self._pool.submit(self._fetch, self._offsets.popleft()))

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            if not self._window:
                return 0
            self._pending = memoryview(self._window.popleft().result())
            self._fill()
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        for future in self._window:
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()
