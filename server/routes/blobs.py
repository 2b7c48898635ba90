"""``/v1/blobs``: which blobs are missing, upload one (hash-checked), download one."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Annotated, Any

import anyio
import zstandard
from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from cachekeeper.errors import (
    BlobMissing,
    DigestMismatch,
    InsufficientStorage,
    RangeNotSatisfiable,
    ServerUnavailable,
    UnsupportedEncoding,
)
from cachekeeper.integrity import DIGEST_PATTERN
from cachekeeper.server.auth import ReadScope, WriteScope, covers
from cachekeeper.server.capacity import Reservation, StoreRoom, store_room
from cachekeeper.server.deps import ServicesDep, metrics_of, services_of
from cachekeeper.server.limits import upload_limiter
from cachekeeper.server.responses import error_responses
from cachekeeper.server.services import Services
from cachekeeper.wire import MissingAnswer, MissingRequest, PutAnswer, to_dict

__all__ = ["router"]

router = APIRouter(prefix="/v1/blobs", tags=["blobs"])

Digest = Annotated[str, Path(pattern=DIGEST_PATTERN, description="lowercase sha256 hex")]
_READ_BYTES = 1 << 20
_END, _ABORT = object(), object()


@router.post("/missing", response_model=MissingAnswer)
def missing_blobs(body: MissingRequest, services: ServicesDep, scope: ReadScope) -> dict[str, Any]:
    """Which of ``digests`` the server does not have; with an object store and a write-scope
    token, also where to PUT them (a presigned PUT writes into the bucket: never for read)."""
    missing = services.blobs.missing(body.digests)
    uploads = services.blobs.upload_targets(missing) if covers(scope, "write") else []
    return {"missing": missing, "uploads": uploads}


class _Aborted(Exception):
    """The client went away before the body ended."""


def _zstd_decoded(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Decompress a zstd body while it streams (output in bounded pieces)."""

    class _Reader:
        def __init__(self) -> None:
            self._it = iter(chunks)
            self._buf = b""

        def read(self, n: int = -1) -> bytes:
            while not self._buf:
                nxt = next(self._it, None)
                if nxt is None:
                    return b""
                self._buf = nxt
            if n < 0 or n >= len(self._buf):
                out, self._buf = self._buf, b""
            else:
                out, self._buf = self._buf[:n], self._buf[n:]
            return out

    reader = zstandard.ZstdDecompressor().stream_reader(
        _Reader(),  # type: ignore[arg-type]
        read_size=_READ_BYTES,
        read_across_frames=True,
    )
    try:
        while out := reader.read(_READ_BYTES):
            yield out
    except zstandard.ZstdError as exc:
        raise DigestMismatch(f"the body is not a valid zstd stream: {exc}") from exc


@router.put(
    "/{digest}",
    status_code=201,
    response_model=PutAnswer,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        }
    },
    responses={
        200: {"model": PutAnswer, "description": "the blob was already stored"},
        **error_responses(
            DigestMismatch,  # also for a body that is not a valid zstd stream
            UnsupportedEncoding,
            InsufficientStorage,
            ServerUnavailable,  # collected by a concurrent GC while uploading: retry
        ),
    },
)
async def put_blob(digest: Digest, request: Request, _: WriteScope) -> Response:
    """Upload a blob; the server hashes what it receives and stores nothing on a mismatch."""
    services = services_of(request)
    metrics = metrics_of(request)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "zstd"):
        return JSONResponse(
            {
                "error": "unsupported_encoding",
                "detail": f"Content-Encoding {encoding!r} is not accepted (identity or zstd)",
            },
            status_code=415,
        )
    length = request.headers.get("content-length")
    declared = int(length) if length and length.isdigit() and len(length) <= 19 else 0
    # Room under the store's cap is reserved as bytes arrive, never by evicting.
    reservation = await run_in_threadpool(
        _reserve, services, store_room(request.app), digest, declared
    )

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=8)
    failed = threading.Event()

    ended = threading.Event()  # the consumer has taken the terminal item

    def body_chunks() -> Iterator[bytes]:
        while not ended.is_set():
            item = asyncio.run_coroutine_threadsafe(queue.get(), loop).result()
            if item is _END or item is _ABORT:
                ended.set()
                if item is _ABORT:
                    raise _Aborted
                return
            yield item

    def consume() -> Any:
        chunks: Iterable[bytes] = body_chunks()
        if reservation is not None:
            chunks = reservation.counted(chunks)
        if encoding == "zstd":
            chunks = _zstd_decoded(chunks)
        landed = 0
        try:
            result = services.blobs.put(digest, chunks)
            landed = result.stored_bytes if result.created else 0
            return result
        except BaseException:
            failed.set()
            raise
        finally:
            if reservation is not None:
                reservation.close(stored_bytes=landed)
            # Drain to the terminal item so the producer below never blocks on a full queue.
            try:
                for _ in body_chunks():
                    pass
            except _Aborted:
                pass

    # Upload threads are bounded apart from the shared pool: stalled or slow uploads wait
    # for one without holding a thread, and never take those of health, resolve, archive.
    task = asyncio.ensure_future(
        anyio.to_thread.run_sync(_swallow_aborted, consume, limiter=upload_limiter(request.app))
    )
    terminal = _END
    try:
        async for chunk in request.stream():
            if failed.is_set():
                break
            if chunk:
                await queue.put(chunk)
    except ClientDisconnect:
        terminal = _ABORT
    await queue.put(terminal)
    result = await task
    if result is None:  # aborted by the client: nothing stored, nobody to answer
        metrics.inc("cachekeeper_blob_uploads_total", result="aborted")
        return Response(status_code=400)
    metrics.inc(
        "cachekeeper_blob_uploads_total", result="created" if result.created else "existing"
    )
    answer = PutAnswer(digest=digest, size_bytes=result.size_bytes, created=result.created)
    return JSONResponse(to_dict(answer), status_code=201 if result.created else 200)


def _reserve(services: Services, room: StoreRoom, digest: str, declared: int) -> Reservation | None:
    """Room for an upload of ``declared`` bytes, or None when the blob is already stored."""
    if services.blobs.has_bytes(digest):
        return None  # nothing will be added
    return room.open(declared_bytes=declared)


def _swallow_aborted(fn: Any) -> Any:
    try:
        return fn()
    except _Aborted:
        return None


_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_HUGE = 10**19  # past any blob: what a longer number means (int() refuses 4,300+ digits)


def _number(digits: str) -> int:
    """A Range bound; one of more than 19 digits is past any blob (never parsed: Python
    refuses to convert 4,300 digits or more, which was a 500)."""
    return int(digits) if len(digits) <= 19 else _HUGE


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a single byte range, or None when unsatisfiable."""
    found = _RANGE_RE.match(header.strip())
    if not found or (not found.group(1) and not found.group(2)):
        return None
    first, last = found.group(1), found.group(2)
    if not first:  # suffix: the last N bytes
        n = _number(last)
        if n == 0 or size == 0:
            return None
        return max(size - n, 0), size - 1
    start = _number(first)
    end = min(_number(last), size - 1) if last else size - 1
    if start >= size or end < start:
        return None
    return start, end


def _slice(services: Services, digest: str, start: int, end: int) -> Iterator[bytes]:
    with services.blobs.open(digest) as fh:
        to_skip = start
        while to_skip:
            skipped = len(fh.read(min(to_skip, _READ_BYTES)))
            if not skipped:
                return
            to_skip -= skipped
        left = end - start + 1
        while left > 0:
            chunk = fh.read(min(left, _READ_BYTES))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


def _raw(services: Services, digest: str) -> Iterator[bytes]:
    with services.blobs.open_raw(digest) as fh:
        while chunk := fh.read(_READ_BYTES):
            yield chunk


@router.get(
    "/{digest}",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}},
        206: {"description": "a range"},
        **error_responses((404, BlobMissing), RangeNotSatisfiable),
    },
)
def get_blob(digest: Digest, request: Request, services: ServicesDep, _: ReadScope) -> Response:
    """The blob's bytes, streamed; ``Range`` supported; ``Accept-Encoding: zstd`` gets the frame."""
    found = services.blobs.get(digest)
    if found is None:
        missing = BlobMissing(f"blob {digest} is not on the server", extra={"missing": [digest]})
        return JSONResponse(missing.to_dict(), status_code=404)  # a GET of nothing is a 404
    metrics_of(request).inc("cachekeeper_blob_downloads_total")
    size = found.size_bytes
    range_header = request.headers.get("range")
    accepts = request.headers.get("accept-encoding", "").lower()
    if range_header is None and "zstd" in [a.split(";")[0].strip() for a in accepts.split(",")]:
        return StreamingResponse(
            _raw(services, digest),
            media_type="application/octet-stream",
            headers={"Content-Encoding": "zstd", "Content-Length": str(found.stored_bytes)},
        )
    if range_header is not None:
        span = _parse_range(range_header, size)
        if span is None:
            return JSONResponse(
                {
                    "error": "range_not_satisfiable",
                    "detail": f"range {range_header!r} is outside 0..{size}",
                },
                status_code=416,
                headers={"Content-Range": f"bytes */{size}"},
            )
        start, end = span
        return StreamingResponse(
            _slice(services, digest, start, end),
            status_code=206,
            media_type="application/octet-stream",
            headers={
                "Content-Length": str(end - start + 1),
                "Content-Range": f"bytes {start}-{end}/{size}",
                "Accept-Ranges": "bytes",
            },
        )
    return StreamingResponse(
        _slice(services, digest, 0, size - 1) if size else iter(()),
        media_type="application/octet-stream",
        headers={"Content-Length": str(size), "Accept-Ranges": "bytes"},
    )
