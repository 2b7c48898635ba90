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
from urllib.parse import urlsplit

from cachekeeper.archive import ReadAhead
from cachekeeper.daemon_pool import DaemonPool
from cachekeeper.errors import ServerUnavailable

from .api import Deadline
from .calls import read_within, tls_context
from .transport import import_httpx as _import_httpx

if TYPE_CHECKING:
    import httpx

__all__ = ["DirectUnavailable", "ObjectStore", "Part", "PART_BYTES", "PARALLEL", "WHOLE_MAX_BYTES"]

PART_BYTES = 8 << 20
PARALLEL = 4
WHOLE_MAX_BYTES = 64 << 20  # the most a store that ignores Range may send in one answer
_RANGE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19})")


class DirectUnavailable(ServerUnavailable):
    """The object store refused or failed a presigned request (the caller falls back)."""


@dataclass(frozen=True)
class Part:
    """One answer of a ranged GET: 206 with the range asked, or 200 with the whole object."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes


def _where(url: str) -> str:
    """The URL without its query (the signature is not for logs) nor a password."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


class ObjectStore:
    """An httpx client for presigned URLs; ``transport`` is the test seam, as CacheClient's."""

    def __init__(
        self, *, timeout_s: float = 30.0, transport: httpx.BaseTransport | None = None
    ) -> None:
        httpx = _import_httpx()
        self.timeout_s = timeout_s
        self._http = httpx.Client(
            transport=transport,
            verify=tls_context(),  # the server's CAs and --ca-bundle's (client/calls.py)
            timeout=timeout_s,
            follow_redirects=False,
            headers={"User-Agent": "cachekeeper-client"},
            limits=httpx.Limits(max_connections=PARALLEL * 2),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_range(self, url: str, start: int, end: int, *, deadline: Deadline | None) -> Part:
        """Bytes ``start..end`` (inclusive) of ``url`` (206), or the whole object (200, at
        most ``WHOLE_MAX_BYTES``); read as they arrive, never past ``deadline``."""
        httpx = _import_httpx()
        deadline = deadline or Deadline(None)
        timeout = deadline.bound(self.timeout_s)
        try:
            with self._http.stream(
                "GET",
                url,
                headers={"Range": f"bytes={start}-{end}"},
                timeout=httpx.Timeout(timeout),
            ) as response:
                status = response.status_code
                if status not in (200, 206):
                    raise DirectUnavailable(
                        f"GET {_where(url)} answered HTTP {status}"
                        + (" (the presigned URL expired or was refused)" if status == 403 else "")
                    )
                limit = end - start + 1 if status == 206 else WHOLE_MAX_BYTES
                what = f"GET {_where(url)} bytes {start}-{end}"
                data = read_within(
                    response.iter_bytes(),
                    limit=limit,
                    deadline=deadline,
                    late=lambda n: DirectUnavailable(
                        f"{what} passed the {deadline.seconds:g} s deadline ({n} bytes in)"
                    ),
                    over=lambda: DirectUnavailable(f"{what} sent more than {limit} bytes"),
                )
                return Part(status, response.headers, data)
        except httpx.TransportError as exc:
            raise DirectUnavailable(f"GET {_where(url)} failed: {exc!r}") from exc

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
        attempts: int = 3,
    ) -> None:
        """PUT ``size_bytes`` from ``open_body()`` to a presigned URL, retrying transport errors."""
        httpx = _import_httpx()
        last: Exception | None = None
        for _ in range(attempts):
            timeout = (deadline or Deadline(None)).bound(self.timeout_s)
            try:
                response = self._http.put(
                    url,
                    content=open_body(),
                    headers={**headers, "Content-Length": str(size_bytes)},
                    timeout=httpx.Timeout(timeout),
                )
            except httpx.TransportError as exc:
                last = exc
                continue
            if response.status_code in (500, 502, 503, 504):
                last = DirectUnavailable(f"HTTP {response.status_code}")
                continue
            if not response.is_success:
                raise DirectUnavailable(
                    f"PUT {_where(url)} answered HTTP {response.status_code}:"
                    f" {response.text[:200]!r}"
                )
            return
        raise DirectUnavailable(f"PUT {_where(url)} failed: {last!r}")


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
        last: Exception | None = None
        for _ in range(2):  # one more try of a part that broke off
            try:
                response = self._store.get_range(self._url, start, end, deadline=self._deadline)
            except DirectUnavailable as exc:
                last = exc
                continue
            data = response.content
            if response.status_code != 206 or len(data) != end - start + 1:
                raise DirectUnavailable(
                    f"GET {_where(self._url)} bytes {start}-{end}: got {len(data)} bytes"
                )
            return data
        raise DirectUnavailable(str(last))

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
